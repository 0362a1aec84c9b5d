import signal

from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import decode_prompt
from common.progress import read_producer, start_producer, write_step
from producers.admission import admission_limit
from tasks.arithmetic import problem
from tests.harness.processes import spawn, stop, wait_for


def test_admission_limit_follows_the_trainer_version():
    # (max_staleness + version + 1) * prompts_per_step, plus groups that will never train
    assert admission_limit(version=0, max_staleness=1, prompts_per_step=4, dropped=0) == 8
    assert admission_limit(version=3, max_staleness=0, prompts_per_step=4, dropped=0) == 16
    assert admission_limit(version=3, max_staleness=0, prompts_per_step=4, dropped=2) == 18


def test_problems_are_deterministic_and_answers_right():
    a = problem(seed=1, index=7, max_operand=20, ops=["+", "-", "*"])
    assert a == problem(seed=1, index=7, max_operand=20, ops=["+", "-", "*"])
    x, op, y = a.question.split("?")[0].removeprefix("What is ").split()
    assert a.answer == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
    seq = [problem(seed=1, index=i, max_operand=20, ops=["+"]).question for i in range(20)]
    assert len(set(seq)) > 10


def admitted_ids(r, keys):
    return [decode_prompt(f[PAYLOAD]).id for _, f in r.xrange(keys.prompts)]


def test_producer_admits_as_the_trainer_advances_and_resumes_after_sigkill(tmp_path, redis_url, r):
    keys = Keys("p")
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "p", "ROLLOUTS_ROLLOUT__PROMPTS_PER_STEP": "3",
           "ROLLOUTS_ROLLOUT__MAX_STALENESS": "1", "ROLLOUTS_ROLLOUT__GROUP_SIZE": "5"}
    proc = spawn("producers", cwd=tmp_path, env=env, log=tmp_path / "producer.log")
    try:
        wait_for(lambda: r.xlen(keys.prompts) >= 6, timeout=60, what="6 prompts at version 0", procs=[proc])
        assert r.xlen(keys.prompts) == 6, "admitted beyond the limit"
        first = decode_prompt(r.xrange(keys.prompts, count=1)[0][1][PAYLOAD])
        assert first.n == 5 and first.meta["answer"] == problem(seed=0, index=0, max_operand=20, ops=["+", "-"]).answer
        write_step(r, keys, step=2, version=2)
        wait_for(lambda: r.xlen(keys.prompts) >= 12, timeout=60, what="12 prompts at version 2", procs=[proc])
        assert r.xlen(keys.prompts) == 12, "admitted beyond the limit"

        proc.send_signal(signal.SIGKILL)
        proc.wait()
        write_step(r, keys, step=4, version=4)
        proc = spawn("producers", cwd=tmp_path, env=env, log=tmp_path / "producer.log")
        # a limit is admitted in one transaction (up to 64 prompts): a wrong one shows at once
        wait_for(lambda: r.xlen(keys.prompts) >= 18, timeout=60, what="18 prompts at version 4", procs=[proc])
        assert r.xlen(keys.prompts) == 18, "admitted beyond the limit"
    finally:
        assert stop(proc) == 0, (tmp_path / "producer.log").read_text()

    assert admitted_ids(r, keys) == [f"arithmetic:0:{i}" for i in range(18)]
    assert read_producer(r, keys).admitted == 18
    assert any(g["name"] == GENERATORS_GROUP.encode() for g in r.xinfo_groups(keys.prompts))


def test_producer_refuses_a_changed_seed(tmp_path, redis_url, r):
    start_producer(r, Keys("p"), seed=0)
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "p", "ROLLOUTS_TASK__SEED": "9"}
    proc = spawn("producers", cwd=tmp_path, env=env, log=tmp_path / "producer.log")
    assert proc.wait(timeout=60) != 0
    assert "task.seed" in (tmp_path / "producer.log").read_text()


def test_the_evaluators_problems_are_the_runs_held_out_split(r):
    """README: pass@1 "on 32 held-out problems (the eval.holdout share of the task's problems ...
    that the producer never admits for training)": the evaluator is asked for the run's own
    sources, on their held-out split (tests/test_evaluator.py checks the producer skips it)."""
    from common.config import load_config, source_config
    from common.evals import enqueue_eval, read_request
    from common.messages import WeightVersion
    from tasks.rows import eval_prompts, held_out
    from tests.harness.processes import ROOT

    cfg = load_config(ROOT / "configs" / "demo.toml", env={})
    wv = WeightVersion(version=10, step=10, path="runs/demo/checkpoints/step_10", format="safetensors",
                       checksums={}, created_at=0.0)
    req = read_request(enqueue_eval(r, cfg, wv).kwargs["spec"])  # what the evaluator is asked
    assert req.prompts == 32 and req.holdout == cfg.eval.holdout > 0
    sources = [source_config(**d) for d in req.sources]
    assert sources == list(cfg.sources)  # the run's own task, not a fixed one
    problems = eval_prompts(sources[0], count=req.prompts, seed=req.seed, holdout=req.holdout)
    assert len(problems) == 32 and all(held_out(p, req.holdout) for p in problems)