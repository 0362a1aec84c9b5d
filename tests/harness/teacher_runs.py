"""A generator run with a teacher ([teacher]) on one prompt: tests/test_teacher.py and
tests/test_teacher_vllm.py (the HF and the vLLM teacher)."""

import tomllib
from pathlib import Path

from common.config import config_from_dict
from common.heartbeats import read_heartbeat
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import PromptTask, decode_group, encode
from tests.harness.processes import spawn, stop, wait_for

PROMPT = "What is 6 * 7?"  # the one prompt, its answer 42


def run_generator(tmp_path: Path, redis_url: str, r, *, model: Path, teacher: Path, run: str,
                  teacher_errors: int = 0, engine: str = "hf", teacher_engine: str = "hf",
                  temperature: float = 0.7) -> tuple[str, list]:
    """The generator's log and the groups it wrote of one prompt, its heartbeat counting `teacher_errors`
    (`engine`: generator.engine; `teacher_engine`: teacher.engine)."""
    config = tmp_path / "run.toml"
    config.write_text(f"""
run = "{run}"
redis_url = "{redis_url}"
[model]
path = "{model}"
[rollout]
max_new_tokens = 4
temperature = {temperature}
[generator]
engine = "{engine}"
threads = 1
[teacher]
path = "{teacher}"
name = "tiny-teacher"
engine = "{teacher_engine}"
[[data.sources]]
name = "calc"
kind = "arithmetic"
reward = "none"
""")
    config_from_dict(tomllib.loads(config.read_text()))  # the table as a user writes it
    keys = Keys(run)
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    r.xadd(keys.prompts, {PAYLOAD: encode(PromptTask(id="calc:0:0", messages=None, text=PROMPT, meta={"answer": 42},
                                                     n=3, admitted_at=0, source="calc"))})
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env={"ROLLOUTS_CONFIG": str(config)}, log=log)
    try:
        wait_for(lambda: r.xlen(keys.samples) >= 1, timeout=180, what="the group", procs=[proc])
        wait_for(lambda: (beat := read_heartbeat(r, keys, "g1")) is not None and beat.teacher_errors == teacher_errors,
                 timeout=60, what=f"a heartbeat counting {teacher_errors} teacher errors", procs=[proc])
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()
    assert r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0  # the prompt acknowledged: not lost, not retried
    return log.read_text(), [decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples)]
