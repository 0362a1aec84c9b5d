import json
import os
import re
import shutil
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from rq.registry import FailedJobRegistry
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.checkpoints import checksum_dir
from common.config import config_from_dict, source_config
from common.evals import enqueue_eval, eval_queue, failed_evals, read_request, unfinished_evals
from common.keys import Keys
from common.messages import WeightVersion
from common.metrics import read_metrics_stream
from tasks.rows import eval_prompts
from tests.harness.needs import need
from tests.harness.processes import spawn

RUN = "ev"


def config(redis_url, engine="hf", threads=0, **eval_fields):
    """The run's config; the evaluator samples with the generators' engine (HF unless a test asks:
    it loads in a second, vLLM in tens on a CPU) on their threads (0: torch's default)."""
    return config_from_dict({"run": RUN, "redis_url": redis_url, "rollout": {"max_new_tokens": 6},
                             "generator": {"engine": engine, "threads": threads},
                             "eval": {"every": 1, "prompts": 4, "retries": 1, **eval_fields}})


def answering_model(tiny_model: Path, path: Path, answer: str) -> Path:
    """A copy of the tiny model whose greedy (and, its logits 80 apart, sampled) completion of
    any prompt is `answer` and then end-of-turn. Its attention and MLP outputs are zeroed, so each
    position's logits are its own token's embedding through the final norm and lm_head: the
    answer's token i embeds as direction i + 1 and lm_head maps it to token i + 1 (the last one to
    end-of-turn); every other token embeds as direction 0, mapped to the answer's first token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(tiny_model, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chain = tokenizer.encode(answer, add_special_tokens=False)
    assert len(set(chain)) == len(chain), f"{answer!r}: its tokens {chain} must differ for this model to say it"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight  # (V, H) each
        embed.zero_()
        embed[:, 0] = 1.0
        head.zero_()
        for i, token in enumerate(chain):
            embed[token] = 0.0
            embed[token, i + 1] = 1.0
        for i, token in enumerate([*chain, tokenizer.eos_token_id]):  # direction i -> the token after
            head[token, i] = 10.0  # the final norm makes a one-hot 8 (the square root of the width): logits 80
    model.save_pretrained(path, safe_serialization=True)
    return path


def burst_worker(tmp_path, redis_url) -> int:
    proc = spawn("evaluator", "--burst", cwd=tmp_path, env={"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": RUN},
                 log=tmp_path / "evaluator.log")
    return proc.wait(timeout=180)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_eval_job_scores_a_checkpoint_into_the_metrics_stream(engine, tmp_path, redis_url, r, tiny_model):
    need(engine)
    cfg = config(redis_url, engine, threads=1, pass_k=2)
    # the held-out problems of the run's own task (built-in arithmetic), and a checkpoint that
    # answers each of them with the answer most of them share: it gets those right, the others wrong
    [source] = cfg.sources
    problems = eval_prompts(source, count=cfg.eval.prompts, seed=cfg.eval.seed, holdout=cfg.holdout)
    assert len(problems) == cfg.eval.prompts
    [(answer, hits)] = Counter(p.meta["answer"] for p in problems).most_common(1)
    assert 0 < hits < len(problems), "the checkpoint must get some problems right and some wrong"
    ckpt = answering_model(tiny_model, tmp_path / "step_3", str(answer))
    wv = WeightVersion(version=3, step=3, path=str(ckpt), format="safetensors",
                       checksums=checksum_dir(ckpt), created_at=0.0)
    job = enqueue_eval(r, cfg, wv)
    # The job travels as JSON, not pickle.
    assert json.loads(zlib.decompress(r.hget(f"rq:job:{job.id}", "data")))

    assert burst_worker(tmp_path, redis_url) == 0, (tmp_path / "evaluator.log").read_text()
    # on the generators' engine, opened from their [generator] table, on as many threads as they
    # (one here: a second one would only spin against the trainer and generators for the cores)
    assert f"evaluator: the {engine} engine (float32, 1 thread)" in (tmp_path / "evaluator.log").read_text()
    [result] = read_metrics_stream(r, Keys(RUN))
    assert result["kind"] == "eval" and result["version"] == 3 and result["eval/prompts"] == 4
    req = read_request(job.kwargs["spec"])
    assert [source_config(**d) for d in req.sources] == [source] and req.prompts == len(problems)
    # pass@1 as a user would work it out: the model's greedy answer to each held-out problem, by
    # transformers' own generate, against the problem's answer
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    right = 0
    for p in problems:
        ids = tokenizer.apply_chat_template(p.messages, add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, do_sample=False, max_new_tokens=req.max_new_tokens, pad_token_id=0)
        said = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert said == str(answer), said
        numbers = re.findall(r"-?\d+", said)
        right += bool(numbers) and int(numbers[-1]) == p.meta["answer"]
    assert right == hits
    assert result["eval/pass@1"] == hits / len(problems)
    # every sample is the greedy answer (its logits are 80 above the rest): pass@2 is pass@1
    assert result["eval/pass@2"] == hits / len(problems)
    assert json.loads(r.hget(Keys(RUN).evals, "3")) == result


def test_failing_eval_job_lands_in_the_failed_registry_after_its_retries(tmp_path, redis_url, r):
    corrupted = tmp_path / "step_1"
    corrupted.mkdir()
    (corrupted / "model.safetensors").write_bytes(b"not the published weights")
    wv = WeightVersion(version=1, step=1, path=str(corrupted), format="safetensors",
                       checksums={"model.safetensors": "0" * 64}, created_at=0.0)
    job = enqueue_eval(r, config(redis_url), wv)
    assert unfinished_evals(r, Keys(RUN)) == [job.id] and failed_evals(r, Keys(RUN)) == []
    assert burst_worker(tmp_path, redis_url) == 0, (tmp_path / "evaluator.log").read_text()
    queue = eval_queue(r, Keys(RUN))
    assert job.id in FailedJobRegistry(queue=queue).get_job_ids()
    assert unfinished_evals(r, Keys(RUN)) == [] and failed_evals(r, Keys(RUN)) == [job.id]
    job.refresh()
    assert job.retries_left == 0
    assert f"checkpoint {corrupted}: model.safetensors has checksum" in job.latest_result().exc_string
    assert r.xlen(Keys(RUN).metrics) == 0


def test_a_checkpoint_pruned_before_its_evaluation_is_reported_skipped(tmp_path, redis_url, r):
    wv = WeightVersion(version=2, step=2, path=str(tmp_path / "checkpoints" / "step_2"), format="safetensors",
                       checksums={"model.safetensors": "0" * 64}, created_at=0.0)
    cfg = config(redis_url).model_copy(update={"output_dir": str(tmp_path / "run")})
    job = enqueue_eval(r, cfg, wv)
    assert burst_worker(tmp_path, redis_url) == 0, (tmp_path / "evaluator.log").read_text()
    job.refresh()
    assert job.get_status() == "finished"  # not retried, not failed: there is nothing left to score
    result = json.loads(r.hget(Keys(RUN).evals, "2"))
    assert result["eval/skipped"] == "checkpoint pruned before its evaluation ran"
    assert [json.loads(line) for line in cfg.evals_path.read_text().splitlines()] == [result]


def pruned_while_opening(monkeypatch, held: Path) -> list[str]:
    """The evaluator's engine opening (evaluator/jobs.py), with the trainer's prune of the hold `held`
    just before it: after the job found the hold and checked its files. The paths it opened on."""
    import evaluator.jobs as jobs

    opened, seen = jobs.open_for_settings, []

    def pruned_first(name, path, **settings):
        seen.append(path)
        shutil.rmtree(held)  # trainer/checkpoints.py hold_for_eval's prune, an evaluation more than 2 behind
        return opened(name, path, **settings)

    monkeypatch.setattr(jobs, "open_for_settings", pruned_first)
    monkeypatch.setattr(jobs, "_ENGINE", {})  # none left loaded by another test in this process
    return seen


def evaluate_in_process(r, redis_url, tmp_path, held: Path):
    """The hold's evaluation queued and worked by an evaluator in this process; its job."""
    from rq.serializers import JSONSerializer

    from evaluator.worker import EvalWorker

    wv = WeightVersion(version=2, step=2, path=str(held), format="safetensors", checksums=checksum_dir(held),
                       created_at=0.0)
    job = enqueue_eval(r, config(redis_url).model_copy(update={"output_dir": str(tmp_path / "run")}), wv)
    EvalWorker([eval_queue(r, Keys(RUN))], connection=r, serializer=JSONSerializer).work(burst=True,
                                                                                      logging_level="WARNING")
    job.refresh()
    return job


def test_a_checkpoint_pruned_while_its_evaluation_opens_the_engine_is_scored_from_the_jobs_pin(
        tmp_path, redis_url, r, tiny_model, monkeypatch):
    """The job reads its checkpoint from hard links of its own beside the hold (evaluator/jobs.py
    pin_for_job): the trainer's prune of the hold while the engine opens (longer on a CPU than the
    demo's ten steps between two evaluations) takes nothing from it. Without the pin the engine's
    tokenizer read failed with the hub's "Repo id must be in the form ...", and the job was retried."""
    held = tmp_path / "run" / "checkpoints" / "evaluating" / "step_2"
    shutil.copytree(tiny_model, held)
    seen = pruned_while_opening(monkeypatch, held)
    job = evaluate_in_process(r, redis_url, tmp_path, held)
    assert job.get_status() == "finished" and job.retries_left == 1  # neither failed nor retried
    result = json.loads(r.hget(Keys(RUN).evals, "2"))
    assert "eval/skipped" not in result and result["eval/prompts"] == 4, result
    assert len(seen) == 1 and Path(seen[0]).parent == held.parent and Path(seen[0]).name.startswith(".pin-"), seen
    assert list(held.parent.iterdir()) == []  # the hold pruned, the job's pin removed at its end


def test_a_checkpoint_that_cannot_be_pinned_and_is_pruned_while_read_is_reported_skipped(
        tmp_path, redis_url, r, tiny_model, monkeypatch):
    """Where no hard links can be made beside the hold (pin_checkpoint returns None: another file
    system, none made there), the job reads the hold itself; pruned meanwhile, it is skipped as a
    checkpoint pruned before its evaluation, not failed and retried."""
    import evaluator.jobs as jobs

    held = tmp_path / "run" / "checkpoints" / "evaluating" / "step_2"
    shutil.copytree(tiny_model, held)
    monkeypatch.setattr(jobs, "pin_checkpoint", lambda path, checksums, pin: None)
    seen = pruned_while_opening(monkeypatch, held)
    job = evaluate_in_process(r, redis_url, tmp_path, held)
    assert seen == [str(held)]
    assert job.get_status() == "finished" and job.retries_left == 1, job.latest_result()
    result = json.loads(r.hget(Keys(RUN).evals, "2"))
    assert result["eval/skipped"] == "checkpoint pruned while its evaluation ran", result
    assert jobs._ENGINE == {}  # the engine that failed to open is not kept


def test_a_job_removes_the_pins_of_this_hosts_evaluators_that_exited_and_keeps_the_others(tmp_path, tiny_model):
    """A SIGKILLed evaluator leaves its pin (hard links: disk, once the checkpoint is pruned); the
    next job on the host removes it, not a running evaluator's, nor another host's (one whose name
    begins with this one's and a "-" too)."""
    import socket
    import subprocess
    import sys

    from common.evals import EvalRequest
    from evaluator.jobs import pin_for_job

    held = tmp_path / "evaluating" / "step_3"
    shutil.copytree(tiny_model, held)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    gone = int(done.stdout)  # a process that has exited
    dead, live, other = (held.parent / f".pin-{host}-{gone}-v1", held.parent / f".pin-{host}-{os.getppid()}-v2",
                         held.parent / f".pin-elsewhere-{gone}-v1")
    longer = held.parent / f".pin-{host}-{gone}-{gone}-v1"  # host "<ours>-<gone>"'s live evaluator's pin
    odd = held.parent / ".pin-"  # a name of no pin's: left alone
    for d in (dead, live, other, longer, odd):
        d.mkdir()
    req = EvalRequest(run=RUN, version=3, step=3, path=str(held), checksums=checksum_dir(held), prompts=1, seed=0,
                      pass_k=0, temperature=1.0, max_new_tokens=4, sources=[], holdout=0.0, pass_reward=1.0,
                      dtype="float32", evals_path="", engine="hf", engine_settings={})
    pin = pin_for_job(req)
    assert pin == held.parent / f".pin-{host}-{os.getpid()}-v3"
    assert sorted(p.name for p in pin.iterdir()) == sorted(req.checksums)
    assert (pin / "model.safetensors").stat().st_ino == (held / "model.safetensors").stat().st_ino
    assert not dead.exists() and live.exists() and other.exists() and longer.exists() and odd.exists()


def test_the_evaluator_runs_only_evaluation_jobs(tmp_path, redis_url, r, tiny_model):
    """Whoever may write RQ's keys can queue a job naming any function; the evaluator fails every
    job but an evaluation (without running or importing what it names) and goes on working."""
    from rq import Callback, Retry

    from common.evals import JOB_FUNCTION

    queue = eval_queue(r, Keys(RUN))
    planted = tmp_path / "planted"
    foreign = queue.enqueue_call("os.mkdir", args=[str(planted)], retry=Retry(max=2))
    callback = queue.enqueue_call(JOB_FUNCTION, kwargs={"spec": {}}, on_failure=Callback("os.mkdir"))
    method = queue.enqueue_call(JOB_FUNCTION, kwargs={"spec": {}})
    method.instance = str(planted)  # the evaluation function's name, but as a method of an object
    method.save()
    wv = WeightVersion(version=1, step=1, path=str(tiny_model), format="safetensors",
                       checksums=checksum_dir(tiny_model), created_at=0.0)
    legit = enqueue_eval(r, config(redis_url), wv)

    assert burst_worker(tmp_path, redis_url) == 0, (tmp_path / "evaluator.log").read_text()
    log = (tmp_path / "evaluator.log").read_text()
    assert not planted.exists(), "the evaluator ran a job that named os.mkdir"
    failed = FailedJobRegistry(queue=queue).get_job_ids()
    assert {foreign.id, callback.id, method.id} <= set(failed), (failed, log)
    foreign.refresh()
    assert foreign.get_status() == "failed" and foreign.retries_left == 0  # refused once, not retried
    assert f"it names 'os.mkdir'; this evaluator runs only {JOB_FUNCTION}" in foreign.latest_result().exc_string
    assert "it names callbacks ['os.mkdir']" in callback.latest_result().exc_string
    assert f"it names \"a method '{JOB_FUNCTION}' of str\"" in method.latest_result().exc_string
    assert f"evaluator: job {foreign.id} refused" in log
    # the worker went on to the evaluation queued after them
    legit.refresh()
    assert legit.get_status() == "finished", log
    assert json.loads(r.hget(Keys(RUN).evals, "1"))["eval/prompts"] == 4


# ---------------------------------------------------------------------- the run's own task, held out


def test_the_held_out_split_is_disjoint_from_what_the_producer_trains_on():
    from common.config import config_from_dict
    from producers.data import Source
    from tasks.rows import eval_prompts

    def shown(p):
        return p.messages[-1]["content"]

    # max_operand = 20: 882 distinct problems; 4000 draws cover nearly all of them
    cfg = config_from_dict({"eval": {"every": 1, "prompts": 1000}})
    assert cfg.holdout == 0.05
    [source] = cfg.sources
    producer = Source(source, seed=0, field="task", holdout=cfg.holdout)
    trained = {shown(producer.take()) for _ in range(4000)}
    held = {shown(p) for p in eval_prompts(source, count=cfg.eval.prompts, seed=cfg.eval.seed, holdout=cfg.holdout)}
    assert len(trained) > 700 and 20 <= len(held) <= 100, (len(trained), len(held))
    assert not trained & held  # not one evaluation problem is ever trained on
    # without evaluation nothing is held out: the producer draws from every problem
    plain = Source(source, seed=0, field="task", holdout=config_from_dict({}).holdout)
    everything = {shown(plain.take()) for _ in range(4000)}
    assert held <= everything


def test_gsm8k_test_split_and_a_trl_reward_per_source_from_local_files(tmp_path, redis_url, r, tiny_model):
    # the first three rows are evaluated: their answers are 7, 6 and 7
    rows = [{"question": f"Tom has {i} apples and buys {b} more. How many now?",
             "answer": f"{i} + {b} = {i + b}\n#### {i + b}"} for i, b in enumerate([7, 5, 5, 2, 3])]
    test_split = tmp_path / "gsm8k_test.jsonl"
    test_split.write_text("".join(json.dumps(row) + "\n" for row in rows))
    gsm8k = {"name": "gsm8k", "path": str(test_split), "split": "test", "template": "{question}",
             "answer_column": "answer", "answer_extractor": "gsm8k"}
    cfg = config_from_dict({"run": RUN, "redis_url": redis_url, "rollout": {"max_new_tokens": 4},
                            "generator": {"engine": "hf"},
                            "eval": {"every": 1, "prompts": 3, "pass_k": 2, "sources": [
                                gsm8k, {**gsm8k, "name": "easy", "reward_funcs": ["tests.reward_fixtures:always"]}]}})
    assert cfg.holdout == 0.0  # evaluation sources of their own: the training sources keep every problem
    ckpt = answering_model(tiny_model, tmp_path / "step_1", "7")  # answers 7 to everything
    wv = WeightVersion(version=1, step=1, path=str(ckpt), format="safetensors",
                       checksums=checksum_dir(ckpt), created_at=0.0)
    enqueue_eval(r, cfg, wv)
    assert burst_worker(tmp_path, redis_url) == 0, (tmp_path / "evaluator.log").read_text()
    [result] = read_metrics_stream(r, Keys(RUN))
    assert result["eval/prompts"] == 6  # 3 problems of each source
    # each source by its own reward: GSM8K's final answer gets 2 of 3 right; the TRL reward passes everything
    assert result["eval/gsm8k/pass@1"] == result["eval/gsm8k/pass@2"] == 2 / 3
    assert result["eval/easy/pass@1"] == result["eval/easy/pass@2"] == 1.0
    assert result["eval/pass@1"] == result["eval/pass@2"] == 5 / 6


def test_the_evaluators_reward_is_shown_the_last_user_message_as_the_generators_is(tmp_path, redis_url, r,
                                                                                  tiny_model):
    # A chat prompt that ends with the start of the assistant's answer: the reward's `prompt` is the
    # question (the last user message), in the evaluator as in the generator (common.rewards.prompt_text).
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 2 + 2?"},
                                             {"role": "assistant", "content": "It is"}]}) + "\n")
    source = {"name": "chat", "path": str(data), "messages_column": "messages",
              "reward": "tests.reward_fixtures:asked_two_plus_two"}
    wv = WeightVersion(version=1, step=1, path=str(tiny_model), format="safetensors",
                       checksums=checksum_dir(tiny_model), created_at=0.0)
    enqueue_eval(r, config(redis_url, prompts=1, sources=[source]), wv)
    assert burst_worker(tmp_path, redis_url) == 0, (tmp_path / "evaluator.log").read_text()
    [result] = read_metrics_stream(r, Keys(RUN))
    assert result["eval/prompts"] == 1 and result["eval/pass@1"] == 1.0, result


def test_asking_more_problems_than_a_synthetic_task_holds_gives_every_held_out_one_without_drawing_millions(
        monkeypatch):
    import tasks.rows
    from tasks.arithmetic import INSTRUCTION

    cfg = config_from_dict({"eval": {"every": 1, "prompts": 2000}})
    [source] = cfg.sources
    # every problem arithmetic's defaults can draw (operands 0..20, + and -), and the held-out share
    everything = {f"What is {a} {op} {b}? {INSTRUCTION}" for a in range(21) for b in range(21) for op in "+-"}
    expected = {q for q in everything if zlib.crc32(q.encode()) / 2**32 < cfg.holdout}
    draws = Counter()
    draw = tasks.rows.synthetic_prompt

    def counted(*args, **kwargs):
        draws["n"] += 1
        return draw(*args, **kwargs)

    monkeypatch.setattr(tasks.rows, "synthetic_prompt", counted)
    held = eval_prompts(source, count=cfg.eval.prompts, seed=cfg.eval.seed, holdout=cfg.holdout)
    assert {p.messages[-1]["content"] for p in held} == expected, (len(held), len(expected))
    # the task is exhausted well before count * 200 / holdout (8 million) draws
    assert draws["n"] < 100_000, draws


def test_the_evaluator_samples_with_the_generators_engine_unless_eval_engine_says_otherwise():
    from common.evals import eval_engine

    def engine(generator: dict, **ev) -> str:
        return eval_engine(config_from_dict({"generator": generator, "eval": ev}))

    assert engine({"engine": "vllm"}) == "vllm" and engine({}) == "auto" and engine({"engine": "hf"}) == "hf"
    assert engine({"engine": "vllm"}, engine="hf") == "hf"
    # a server engine samples on a server the evaluator does not lease: the evaluator uses HF
    assert engine({"engine": "openai", "server_url": "http://127.0.0.1:1"}) == "hf"


@pytest.mark.parametrize("nice", [None, 0, 15])
def test_the_evaluator_takes_the_cpu_the_trainer_and_generators_leave(nice, tmp_path, redis_url):
    """eval.nice (10 unless set): the evaluator lowers its CPU priority before anything of it
    starts, so every thread of it runs at that niceness; 0 leaves it at the priority it was
    started with."""
    import psutil

    from tests.harness.processes import wait_for

    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": RUN}
    if nice is not None:
        env["ROLLOUTS_EVAL__NICE"] = str(nice)
    log = tmp_path / "evaluator.log"
    proc = spawn("evaluator", cwd=tmp_path, env=env, log=log)
    try:
        wait_for(lambda: "waiting for jobs" in log.read_text(), timeout=120, what="the evaluator to start",
                 procs=[proc])
        threads = {t.id: psutil.Process(t.id).nice() for t in psutil.Process(proc.pid).threads()}
        # it starts at this process's niceness (above 0 where the suite runs under `nice`) and only lowers it
        assert set(threads.values()) == {max(os.nice(0), 10 if nice is None else nice)}, threads
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, log.read_text()


def test_a_reply_out_of_step_at_the_workers_end_is_retried_and_never_fails_the_stop(redis_url, r, monkeypatch,
                                                                                   capsys):
    """RQ records a worker's end in one transaction; a reply out of step there once made a cleanly
    stopped evaluator exit 1. The record is tried again on a fresh connection (the worker leaves the
    registry); if that fails too it is said, and the worker's stop still raises nothing."""
    import redis as redis_py
    from rq.serializers import JSONSerializer
    from rq.worker_registration import get_keys

    from evaluator.worker import EvalWorker

    queue = eval_queue(r, Keys(RUN))
    failures = {"left": 1}
    execute = redis_py.client.Pipeline.execute

    def flaky(self, *args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise redis_py.exceptions.ResponseError("Wrong number of response items from pipeline execution")
        return execute(self, *args, **kwargs)

    for fail in (1, 2):
        worker = EvalWorker([queue], connection=r, serializer=JSONSerializer)
        worker.register_birth()
        assert worker.key in get_keys(connection=r)
        failures["left"] = fail
        monkeypatch.setattr(redis_py.client.Pipeline, "execute", flaky)
        worker.register_death()  # raises nothing either way
        monkeypatch.setattr(redis_py.client.Pipeline, "execute", execute)
        registered = worker.key in get_keys(connection=r)
        assert registered == (fail == 2), (fail, registered)
    assert "could not record this worker's end in Redis" in capsys.readouterr().out
