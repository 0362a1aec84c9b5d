"""Real servers on free ports, for tests and benchmarks: a redis-server (appendonly on,
common/localredis.py), and a `vllm serve` started as the server engine (engines/openai_engine.py)
needs it (ops/lib/servers.py)."""

from common.localredis import PORT_LOCKS, PORT_RANGE, free_port, start_redis  # noqa: F401 (the harness's)
from ops.lib.servers import vllm_server  # noqa: F401 (the harness's)
