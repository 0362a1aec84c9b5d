"""The whole loop as separate OS processes: redis, producer, two generators, trainer."""

import re

from common.cli import status_lines
from common.heartbeats import read_heartbeat
from common.keys import GENERATORS_GROUP, Keys
from common.progress import read_dropped, read_trainer
from engines.choice import vllm_available
from tests.harness.audit import accounting, assert_accounted
from tests.harness.configs import write_config
from tests.harness.groups import read_groups
from tests.harness.metrics import read_steps
from tests.harness.processes import spawn, stop, wait_for

STEPS = 3
PROMPTS_PER_STEP = 4


def test_pipeline_trains_with_two_generators_and_loses_nothing(tmp_path, redis_url, r, tiny_model):
    keys = Keys("e2e")
    env = write_config(tmp_path / "run.toml", run="e2e", redis_url=redis_url, output_dir=tmp_path / "run",
                       model=tiny_model, base={},
                       rollout={"group_size": 4, "prompts_per_step": PROMPTS_PER_STEP, "max_staleness": 1,
                                "max_new_tokens": 8},
                       generator={"batch_prompts": 2, "threads": 1},
                       trainer={"lr": 1e-3, "sync_every": 1, "max_steps": STEPS, "micro_batch_size": 8, "threads": 1},
                       eval={"every": 2, "prompts": 4})
    log = tmp_path / "logs"
    log.mkdir()
    procs = {
        "g1": spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=log / "g1.log"),
        "g2": spawn("generators", "--id", "g2", cwd=tmp_path, env=env, log=log / "g2.log"),
        "trainer": spawn("trainer", cwd=tmp_path, env=env, log=log / "trainer.log"),
        "evaluator": spawn("evaluator", cwd=tmp_path, env=env, log=log / "evaluator.log"),
    }
    try:
        # Prompts are admitted once both generators read the prompts stream, so that both take
        # some (one that starts its engine later would otherwise find the run's few prompts taken).
        def both_reading():
            return {c["name"] for c in r.xinfo_consumers(keys.prompts, GENERATORS_GROUP)} >= {b"g1", b"g2"}
        wait_for(lambda: r.exists(keys.prompts) and both_reading(), timeout=180,
                 what="g1 and g2 reading prompts", procs=[procs["g1"], procs["g2"]])
        procs["producer"] = spawn("producers", cwd=tmp_path, env=env, log=log / "producer.log")
        assert procs["trainer"].wait(timeout=300) == 0, (log / "trainer.log").read_text()

        # Both generators sampled groups, and both load the new weights, even with nothing left to
        # sample (the run's last prompts may all go to one of them).
        seen = {}  # the groups as they come: publishing trims the stream (empty at the end on a fast machine)

        def both_on_v2():
            seen.update((g.id, g) for g in read_groups(r, keys))
            beats = [read_heartbeat(r, keys, gid) for gid in ("g1", "g2")]
            return all(b is not None and b.version >= 2 and b.groups > 0 for b in beats) \
                and any(g.version >= 2 for g in seen.values())
        wait_for(both_on_v2, timeout=180, what="g1 and g2 heartbeats at version >= 2 with groups written",
                 procs=[procs["g1"], procs["g2"]], poll=0.05)
        # Each group is stamped with the version it was sampled with: a generator's versions only
        # go up, and the ones sampled after the trainer published version 2 say so.
        stamped: dict[str, list[int]] = {}
        for g in seen.values():  # in stream order: first seen first
            stamped.setdefault(g.generator, []).append(g.version)
        assert all(vs == sorted(vs) for vs in stamped.values()), stamped
        assert max(v for vs in stamped.values() for v in vs) >= 2, stamped
        # The trainer queued an evaluation of version 2 (every = 2); the evaluator scored it.
        wait_for(lambda: r.hexists(keys.evals, "2"), timeout=120, what="evaluation of version 2",
                 procs=[procs["evaluator"]])
        screen = "\n".join(status_lines(r, "e2e"))  # what `rollouts status` shows of the live run
        assert f"step {STEPS}  version {STEPS}" in screen
        assert re.search(r"producer   admitted \d+", screen), screen
        assert re.search(r"prompts    waiting \d+  in flight \d+  dead 0", screen), screen
        assert re.search(r"samples    stream \d+  waiting \d+  unacknowledged \d+  dead 0", screen), screen
        assert re.search(r"last step \d+\.\ds \(waiting for data \d+%\)  \d+ tok/s  "
                         r"staleness \d\.\d mean / \d max", screen), screen
        for gid in ("g1", "g2"):
            engine = "vllm" if vllm_available() else "hf"  # generator.engine = "auto"
            assert re.search(rf"generator  {gid}  {engine}  v\d+  \d+\.\d tok/s  in flight \d+  heartbeat \d+s ago",
                             screen), screen
        assert "DEAD" not in screen
        assert "eval       v2  pass@1" in screen
    finally:
        codes = {name: stop(p) for name, p in procs.items()}
    assert codes == {"producer": 0, "g1": 0, "g2": 0, "trainer": 0, "evaluator": 0}, {
        n: (log / f"{n}.log").read_text()[-3000:] for n, c in codes.items() if c}

    # ---- every trained group came through the samples stream, once
    metrics = read_steps(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    trained_per_step = [m["group_ids"] for m in metrics]
    trained = [gid for ids in trained_per_step for gid in ids]
    assert len(trained) == STEPS * PROMPTS_PER_STEP
    assert len(set(trained)) == len(trained), "a group was trained twice"
    assert {m.decode() for m in r.zrange(keys.trained, 0, -1)} == set(trained)
    assert all(m["staleness/max"] <= 1 for m in metrics)

    # ---- the trainer published a checkpoint per step and the run's version says so
    assert read_trainer(r, keys).version == STEPS
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["evaluating", "step_1", "step_2", "step_3"]
    # version 2's evaluation was queued on a hold of its files (hard links), which outlives pruning
    assert [p.name for p in (checkpoints / "evaluating").iterdir()] == ["step_2"]
    assert (checkpoints / "evaluating" / "step_2" / "model.safetensors").stat().st_ino == \
        (checkpoints / "step_2" / "model.safetensors").stat().st_ino

    # ---- no prompt was lost: admitted = trained + dropped + still pending somewhere (the streams
    # were trimmed of what was acknowledged as the run went)
    acc = accounting(r, keys)
    assert acc["trained"] == len(trained) and acc["dead_groups"] == 0
    # a healthy run admits no more than it trains in time: nothing went stale (a stale group is
    # dropped before it is measured, so metrics' staleness/max alone could not tell)
    assert acc["dropped_stale"] == 0 and read_dropped(r, keys) == 0, acc
    assert_accounted(acc)
    assert r.xlen(keys.samples) < acc["sample_entries"] and r.xlen(keys.prompts) < acc["prompt_entries"]
