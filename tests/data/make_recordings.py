"""Make the recordings under tests/data/ with the project's own pipeline (run from the repo root):

    python -m tests.data.make_recordings

A real redis-server, the tiny model (common/tiny.py, seed 0: the same bytes every time; the
recordings' headers carry its checksums), then `rollouts record` of the samples and prompts
streams while producer, generator and trainer run STEPS steps.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common.keys import Keys
from common.tiny import build_tiny_model
from tests.harness.processes import spawn, stop, wait_for
from tests.harness.servers import free_port, start_redis

HERE = Path(__file__).resolve().parent
RUN = "rec"
STEPS = 3
CONFIG = """
run = "{run}"
redis_url = "{url}"
output_dir = "{out}"
[model]
path = "{model}"
[rollout]
group_size = 4
prompts_per_step = 4
max_staleness = 1
max_new_tokens = 8
[generator]
batch_prompts = 4
threads = 1
seed = 0
[trainer]
lr = 1e-3
max_steps = {steps}
micro_batch_size = 8
threads = 1
"""


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-rec-"))
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis_proc = start_redis(tmp / "redis", port)
    model = build_tiny_model(tmp / "model", seed=0)
    config = tmp / "run.toml"
    config.write_text(CONFIG.format(run=RUN, url=url, out=tmp / "out", model=model, steps=STEPS))
    env = {"ROLLOUTS_CONFIG": str(config)}
    logs = tmp / "logs"
    logs.mkdir()
    recorder = spawn("common.cli", "record", "--stream", "samples", "--stream", "prompts", "--until-idle", "20",
                     "--out", str(tmp / "tiny_pipeline.rec"), cwd=tmp, env=env, log=logs / "record.log")
    import redis

    r = redis.Redis.from_url(url)
    wait_for(lambda: len(r.xinfo_groups(Keys(RUN).samples)) if r.exists(Keys(RUN).samples) else 0,
             timeout=30, what="the recorder's group", procs=[recorder])
    procs = [spawn("producers", cwd=tmp, env=env, log=logs / "producer.log"),
             spawn("generators", "--id", "g1", cwd=tmp, env=env, log=logs / "g1.log"),
             spawn("trainer", cwd=tmp, env=env, log=logs / "trainer.log")]
    try:
        assert procs[2].wait(timeout=600) == 0, (logs / "trainer.log").read_text()
        # the generator works through what admission allows, then the recorder falls idle
        assert recorder.wait(timeout=600) == 0, (logs / "record.log").read_text()
    finally:
        for p in procs:
            stop(p)
        redis_proc.terminate()
    shutil.copy(tmp / "tiny_pipeline.rec", HERE / "tiny_pipeline.rec")
    subprocess.run(["ls", "-l", str(HERE / "tiny_pipeline.rec")], check=True)
    print((logs / "record.log").read_text(), file=sys.stderr)


if __name__ == "__main__":
    main()
