"""Real servers on free ports, for tests and benchmarks: a redis-server (appendonly on,
common/localredis.py), and a `vllm serve` and an SGLang server started as the server engines
(engines/openai_engine.py, engines/sglang_engine.py) need them (ops/lib/servers.py)."""

from common.localredis import PORT_LOCKS, PORT_RANGE, free_port, start_redis  # noqa: F401 (the harness's)
from ops.lib.servers import sglang_server, vllm_server  # noqa: F401 (the harness's)
