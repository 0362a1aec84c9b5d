"""A generator whose behaviour log-probs depart from the trainer's is quarantined, told, readmitted
when it agrees again, and stopped when it does not; honest staleness is not mistaken for a fault.

By hand: the judge's rules and the trainer's per-group mismatch. Live: a run with three real
generator processes: one honest, one sampling at another temperature than the trainer's (it
stays wrong: quarantined, then stopped), one started on other weights (it loads the trainer's at
the next publish: quarantined, then readmitted). Nothing is lost and nothing is trained twice."""

import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import QuarantineConfig
from common.keys import Keys
from common.messages import Completion, SampleGroup
from common.progress import read_trainer
from common.quarantine import Quarantine, read_quarantines
from tests.harness.audit import accounting, assert_accounted
from tests.harness.configs import write_config
from tests.harness.metrics import read_steps
from tests.harness.models import perturbed_copy
from tests.harness.processes import spawn, stop, wait_for
from trainer.quarantine import Figure, Judge, departs
from trainer.step import GrpoOptions, train_step

CFG = QuarantineConfig(after=3, max_mismatch=0.01, peer_factor=4.0)


def fig(generator: str, gap: float, staleness: int = 0) -> Figure:
    return Figure(generator=generator, engine="hf", staleness=staleness, gap=gap)


def test_a_group_departs_above_the_bound_when_fresh_and_beyond_its_peers_when_stale():
    assert departs(fig("a", 0.005), [], bound=0.01, peer_factor=4) is False
    assert departs(fig("a", 0.05), [], bound=0.01, peer_factor=4) is True
    assert departs(fig("a", math.nan), [], bound=0.01, peer_factor=4) is None  # no trained token
    # stale: honest groups drift as the trainer moves on; judged against the others at that staleness
    peers = [fig("b", 0.03, 2), fig("c", 0.05, 2), fig("d", 0.9, 1)]
    assert departs(fig("a", 0.1, 2), peers, bound=0.01, peer_factor=4) is False  # 0.1 <= 4 x 0.04
    assert departs(fig("a", 0.2, 2), peers, bound=0.01, peer_factor=4) is True
    assert departs(fig("a", 0.2, 3), peers, bound=0.01, peer_factor=4) is None  # no peer at staleness 3
    assert departs(fig("a", 0.2, 2), [fig("a", 0.01, 2)], bound=0.01, peer_factor=4) is None  # itself is no peer


def test_three_in_a_row_quarantine_then_agreeing_readmits_and_departing_again_is_final():
    judge = Judge(CFG, bound=0.01)
    new, back = judge.observe([fig("bad", 0.2), fig("ok", 0.0), fig("bad", 0.3)], step=1, now=10.0, quarantined={})
    assert new == [] and back == []
    new, _ = judge.observe([fig("bad", 0.001), fig("bad", 0.2)], step=2, now=11.0, quarantined={})
    assert new == []  # an agreeing group broke the run
    new, _ = judge.observe([fig("bad", 0.2), fig("bad", 0.5), fig("bad", 0.2)], step=3, now=12.0, quarantined={})
    [q] = new
    assert (q.generator, q.strikes, q.step, q.at, q.groups) == ("bad", 1, 3, 12.0, 3) and not q.final
    assert q.gap == pytest.approx(0.3) and "above 0.01" in q.reason and "temperature" in q.reason
    held = {"bad": q}
    # on probation: three agreeing groups readmit it
    assert judge.observe([fig("bad", 0.0)] * 2, step=4, now=13.0, quarantined=held) == ([], [])
    assert judge.observe([fig("bad", 0.0)], step=5, now=14.0, quarantined=held) == ([], ["bad"])
    # ... three departing ones make it final
    judge = Judge(CFG, bound=0.01)
    [again], _ = judge.observe([fig("bad", 0.2)] * 3, step=6, now=15.0, quarantined=held)
    assert again.strikes == 2 and again.final
    assert judge.observe([fig("bad", 0.2)] * 3, step=7, now=16.0, quarantined={"bad": again}) == ([], [])


def test_a_quarantine_turns_away_groups_of_weights_published_before_it_and_all_once_final():
    q = Quarantine(generator="g", at=100.0, step=3, strikes=1, gap=0.2, bound=0.01, groups=3, reason="r")
    assert q.turns_away(99.0) and q.turns_away(100.0) and not q.turns_away(100.5)  # probation after
    final = Quarantine(generator="g", at=100.0, step=5, strikes=2, gap=0.2, bound=0.01, groups=3, reason="r")
    assert final.turns_away(1e12)


def test_the_trainer_measures_each_group_against_its_own_sampler(tiny_model):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompt = [5, 6, 7]

    def group(gid: str, shift: float) -> SampleGroup:
        completions = []
        for i in range(4):
            ids = [8 + i, 9, 10 + i]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
            honest = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            completions.append(Completion(ids=ids, logprobs=(honest + shift).tolist(), reward=float(i % 2),
                                          rewards={}, finish="stop", text=""))
        return SampleGroup(id=gid, prompt_id=gid, prompt_ids=prompt, version=0, generator=gid, engine="hf",
                           completions=completions)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    how = GrpoOptions.of(*_trainer_and_rollout())
    stats = train_step(model, opt, [group("honest", 0.0), group("off", -0.5)], how=how, step=0)
    honest, off = stats.group_mismatch
    assert honest < 1e-5 and abs(off - 0.5) < 1e-4, stats.group_mismatch


def _trainer_and_rollout():
    from common.config import config_from_dict

    c = config_from_dict({"trainer": {"micro_batch_size": 4}})
    return c.trainer, c.rollout


# ---------------------------------------------------------------------- live


RUN = "qu"
KEYS = Keys(RUN)


def test_wrong_generators_are_quarantined_while_a_good_one_trains_on(tmp_path, redis_url, r, tiny_model):
    other = perturbed_copy(tiny_model, tmp_path / "other", seed=7)
    env = write_config(tmp_path / "run.toml", run=RUN, redis_url=redis_url, output_dir=tmp_path / "run",
                       model=tiny_model,
                       rollout={"group_size": 4, "prompts_per_step": 3, "max_new_tokens": 8, "max_staleness": 6},
                       generator={"engine": "hf", "threads": 1, "max_in_flight": 1},
                       # weights published every 6 steps: the one started on other weights samples
                       # with them until the first publish
                       trainer={"max_steps": 1000, "lr": 1e-4, "threads": 1, "sync_every": 6,
                                "quarantine": {"after": 2}})
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = {"producer": spawn("producers", cwd=tmp_path, env=env, log=logs / "producer.log")}
    generators = [("other", ("--model.path", str(other))), ("good", ()), ("hot", ("--rollout.temperature", "3.0"))]
    for name, args in generators:
        procs[name] = spawn("generators", "--id", name, *args, cwd=tmp_path, env=env, log=logs / f"{name}.log")
        if name == "other":  # its groups on other weights wait for the trainer: judged however fast its steps
            wait_for(lambda: r.xlen(KEYS.samples) >= 3, timeout=300, what="three groups on other weights",
                     procs=list(procs.values()))
    procs["trainer"] = spawn("trainer", cwd=tmp_path, env=env, log=logs / "trainer.log")
    log = {name: logs / f"{name}.log" for name in procs}
    try:
        # the hot one stays wrong: quarantined, then (its next groups departing again) stopped
        wait_for(lambda: (q := read_quarantines(r, KEYS).get("hot")) is not None and q.final, timeout=600,
                 what="the generator at another temperature quarantined for good", procs=list(procs.values()))
        # the one on other weights loads the trainer's at a publish: quarantined, then readmitted
        wait_for(lambda: "generator other readmitted" in log["trainer"].read_text(), timeout=600,
                 what="the generator on other weights readmitted", procs=list(procs.values()))
        status = _status(tmp_path, env)
        step_then = read_trainer(r, KEYS).step
        wait_for(lambda: read_trainer(r, KEYS).step >= step_then + 3, timeout=300,
                 what="three more steps with the good generator", procs=list(procs.values()))
    finally:
        codes = {name: stop(p, timeout=120) for name, p in procs.items()}
    out = {name: path.read_text() for name, path in log.items()}
    assert all(code == 0 for code in codes.values()), {n: out[n][-2000:] for n in procs}
    assert "generator good" not in out["trainer"], out["trainer"][-3000:]  # never judged wrong
    assert "QUARANTINED" in status and "hot" in status and "stopped sampling" in status, status
    assert re.search(r"generator hot quarantined at step \d+ \(strike 1", out["trainer"]), out["trainer"][-3000:]
    assert re.search(r"generator other quarantined at step \d+ \(strike 1", out["trainer"]), out["trainer"][-3000:]
    assert "it stops sampling" in out["hot"] and "readmitted by the trainer" in out["other"]
    assert "dead-lettered group" in out["trainer"]  # the quarantined ones' groups, with the figures
    assert_accounted(accounting(r, KEYS))
    trained = [g for step in read_steps(tmp_path / "run" / "metrics.jsonl") for g in step["group_ids"]]
    assert len(trained) == len(set(trained)), "a group trained twice"


def _status(tmp_path, env) -> str:
    import subprocess
    import sys

    from tests.harness.processes import process_env

    done = subprocess.run([sys.executable, "-m", "common.cli", "status"], cwd=tmp_path, env=process_env(env),
                          capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr
