"""Evaluation jobs: score a published checkpoint on the run's own task, held out; results to the metrics stream.

The problems and the reward come from the run's sources: each training source's held-out split
(problems the producer passes over, `eval.holdout`), or named evaluation sources (`[[eval.sources]]`,
e.g. GSM8K's test split from a local file). Pass@1 is greedy, pass@k from k samples, per source.

The evaluator is an RQ SimpleWorker (no fork per job), so the engine loaded by the first job
stays loaded: later jobs only swap in the new checkpoint's weights.

A stop (SIGTERM, Ctrl-C) in the middle of a job ends it between problems, CHUNK at a time, not at
its end (which on a CPU can be a minute away, past the launcher's grace): the job raises
`Interrupted`, records nothing, and the worker puts it back at the front of the queue
(evaluator/worker.py), for the next evaluator to start again.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from rq import get_current_job

from common import rewards
from common.checkpoints import CheckpointError, adapter_base, adapter_rank, is_adapter_dir, pin_checkpoint, verify_dir
from common.config import GeneratorConfig, SourceConfig, source_config
from common.evals import EvalRequest, EvalResult, read_request, record_eval
from common.keys import Keys
from common.messages import MessageError, PromptTask
from engines.base import Engine, SamplingSettings
from engines.choice import engine_name, open_for_settings
from tasks.rows import Prompt, eval_prompts

# The worker process's one loaded engine, under what it was opened for: the engine's name, or, for
# LoRA adapters, "<name> with adapters on <base model>". A job function is all RQ can call, so the
# state an RQ worker keeps between jobs lives here; nothing else reads it.
_ENGINE: dict[str, Engine] = {}
# Set by the worker on a stop request: the job in hand ends before its next CHUNK of problems.
STOP = threading.Event()
CHUNK = 8  # problems generated in one batch, between two looks at STOP
PIN = ".pin-"  # a job's hard links to its checkpoint, beside it: .pin-<host>-<pid>-v<version>


class Interrupted(Exception):
    """The evaluator was asked to stop in the middle of this job; it goes back on the queue."""


def stop_if_asked(req: EvalRequest) -> None:
    if STOP.is_set():
        raise Interrupted(f"stopped in the middle of evaluating version {req.version}")


def engine_for(req: EvalRequest) -> Engine:
    """The loaded engine (the request's, opened as a generator opens it from the same [generator]
    table) with the weights of the checkpoint it names in it; a LoRA adapter on the base model it
    names (the engine opened again where it was opened for another base or for full weights)."""
    name = engine_name(req.engine)
    adapter = is_adapter_dir(req.path)  # trainer.lora.publish = "adapter": loaded onto its base model
    if adapter and name not in ("hf", "vllm"):
        raise ValueError(f"evaluator: checkpoint {req.path} is a LoRA adapter (trainer.lora.publish = \"adapter\") "
                         f"and the {name} engine cannot load adapters: set eval.engine = \"hf\" or \"vllm\"")
    opened_on = adapter_base(req.path) if adapter else req.path
    # An adapter goes on its base model as it was: not on full weights loaded before (a checkpoint
    # published merged), nor on another base; full weights do not go into an engine holding adapters.
    key = f"{name} with adapters on {opened_on}" if adapter else name
    engine = _ENGINE.get(key)
    if engine is None:
        _ENGINE.clear()  # one engine in memory: a run whose engine changed gets the new one alone
        settings = GeneratorConfig.model_validate({**req.engine_settings, "inflight_updates": False,
                                                   "routing_replay": False})  # nothing trains on its samples
        engine = _ENGINE[key] = open_for_settings(name, opened_on, settings=settings, dtype=req.dtype, seed=0,
                                                  max_running=CHUNK * max(req.pass_k, 1),
                                                  lora_rank=adapter_rank(req.path) if adapter else 0)
        engine.version = 0 if adapter else req.version
        threads = torch.get_num_threads()  # the generators' generator.threads, or torch's default
        print(f"evaluator: the {name} engine ({req.dtype}, {threads} thread{'s' * (threads > 1)}) on {opened_on}",
              flush=True)
    if engine.version != req.version:
        try:
            engine.load_weights(req.path, version=req.version)
        except BaseException:
            # its weights may be part old, part new (vLLM's reload lets go of each layer's tensors
            # as it goes): the next job opens an engine afresh instead of scoring those
            _ENGINE.clear()
            raise
    return engine


def evaluate_checkpoint(*, spec: dict) -> dict:
    """Greedy pass@1 (and sampled pass@k if asked) of a checkpoint on each evaluation source's
    problems, scored by the source's own reward functions; the result (as written to the metrics
    stream) is also the job's return value. The job reads the checkpoint from a pin of its own
    (`pin_for_job`); a checkpoint pruned before it was pinned is reported skipped."""
    req = read_request(spec)
    keys = Keys(req.run)
    r = get_current_job().connection
    # The trainer holds the checkpoints of the newest queued evaluations (2: trainer.checkpoints.
    # hold_for_eval); an evaluator further behind finds older ones gone, reported as skipped
    # (retrying cannot bring them back).
    before = EvalResult(step=req.step, version=req.version, skipped="checkpoint pruned before its evaluation ran")
    if not Path(req.path).is_dir():
        return report(r, keys, before, req)
    try:
        pin = pin_for_job(req)
    except CheckpointError:
        if Path(req.path).is_dir():
            raise  # a listed file missing from a checkpoint that is there: the job fails
        return report(r, keys, before, req)  # pruned between the look and the links
    try:
        result = evaluate(req if pin is None else replace(req, path=str(pin)))
    except Interrupted:
        raise
    except Exception as err:
        if pin is not None and isinstance(err, CheckpointError):  # named as published, not as the job's links
            raise CheckpointError(str(err).replace(str(pin), req.path)) from None
        if pin is not None or Path(req.path).is_dir():
            raise  # a bad checkpoint, or the engine's own failure: the job fails (and is retried)
        # Unpinned (no links where it lies), pruned while the engine read it (as the hub's "Repo id
        # must be in the form ..." where a tokenizer's directory went): skipped alike, not retried.
        print(f"evaluator: version {req.version}: its checkpoint went while it was read "
              f"({type(err).__name__}: {str(err)[:200]})", flush=True)
        result = EvalResult(step=req.step, version=req.version, skipped="checkpoint pruned while its evaluation ran")
    finally:
        if pin is not None:
            shutil.rmtree(pin, ignore_errors=True)
    return report(r, keys, result, req)


def pin_for_job(req: EvalRequest) -> Path | None:
    """Hard links to the checkpoint's files in a directory of this job's own beside it
    (common/checkpoints.py `pin_checkpoint`), which the job reads from: the trainer prunes the hold
    of an evaluation more than two behind whenever it publishes, and an engine opening on the CPU
    takes longer than the demo's ten steps. None where no links can be made there (read-only, or
    no hard links): the checkpoint is read where it is. CheckpointError where a listed file is gone.
    This host's pins of evaluators that have exited (SIGKILLed mid-job) are removed first."""
    root, host = Path(req.path).parent, socket.gethostname()
    for old in root.glob(f"{PIN}*"):
        named, pid, _ = ([*old.name.removeprefix(PIN).rsplit("-", 2), "", ""])[:3]  # a host's name may hold "-"
        if named == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    pin = root / f"{PIN}{host}-{os.getpid()}-v{req.version}"
    shutil.rmtree(pin, ignore_errors=True)  # left by a job of this process's own that was stopped
    try:
        return pin_checkpoint(req.path, req.checksums, pin)
    except OSError:  # no directory of our own can be made there (a file gone: CheckpointError)
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def evaluate(req: EvalRequest) -> EvalResult:
    """Score the checkpoint `req` names on each of its sources (Interrupted if asked to stop)."""
    t0 = time.monotonic()
    verify_dir(req.path, req.checksums)  # a bad checkpoint fails the job (and is retried)
    stop_if_asked(req)
    engine = engine_for(req)
    by_source: dict[str, dict[int, list[bool]]] = {}
    for spec_source in req.sources:
        stop_if_asked(req)
        source = source_config(spec_source)
        problems = eval_prompts(source, count=req.prompts, seed=req.seed, holdout=req.holdout or None)
        if len(problems) < req.prompts:
            split = "held-out " if req.holdout else ""
            print(f"evaluator: {source.name} has {len(problems)} distinct {split}problems; eval.prompts asks "
                  f"{req.prompts}", flush=True)
        if problems:
            by_source[source.name] = score_source(engine, source, problems, req)
    everything = {k: [hit for hits in by_source.values() for hit in hits[k]] for k in (1, req.pass_k) if k}
    return EvalResult(step=req.step, version=req.version, prompts=len(everything[1]),
                      pass_at={k: sum(hits) / max(len(hits), 1) for k, hits in everything.items()},
                      by_source={name: {k: sum(h) / len(h) for k, h in hits.items()}
                                 for name, hits in by_source.items()},
                      seconds=time.monotonic() - t0)


def score_source(engine: Engine, source: SourceConfig, problems: list[Prompt],
                 req: EvalRequest) -> dict[int, list[bool]]:
    """{1: greedy hit per problem, k: whether any of k samples hit}; a hit is a reward of at least
    req.pass_reward from the source's reward functions (an error is a miss). A problem's images
    (a visual task's, or a data set's image_column) are shown as the generator shows them
    (common/vision.py); a model that takes no images refuses the source, naming it (MessageError)."""
    funcs = rewards.load_all(source.reward_functions)
    conversational = rewards.conversational(source)  # TRL functions get messages, else text
    tasks = [PromptTask(id=p.id, messages=p.messages, text=p.text, meta=p.meta, n=1, admitted_at=req.version,
                        images=p.images) for p in problems]
    try:
        prompts = [engine.prompt_ids(t) for t in tasks]
    except MessageError as err:
        raise MessageError(f"evaluator: source {source.name!r}: {err}") from None
    images = [t.images for t in tasks]

    def hits(task: PromptTask, completions: list[list[int]]) -> list[bool]:
        texts = [(engine.decode(ids), ids) for ids in completions]
        scored = rewards.score_group(funcs, prompt=rewards.prompt_text(task),
                                     messages=task.messages if conversational else None, completions=texts,
                                     meta=task.meta, state=rewards.TrainerState(global_step=req.version))
        return [error is None and reward >= req.pass_reward for reward, _, error in scored]

    greedy = in_chunks(lambda chunk, shown: engine.greedy(chunk, max_new_tokens=req.max_new_tokens, **shown),
                       prompts, images, req)
    out = {1: [hits(t, [ids])[0] for ids, t in zip(greedy, tasks, strict=True)]}
    if req.pass_k:
        sampling = SamplingSettings(n=req.pass_k, max_new_tokens=req.max_new_tokens, temperature=req.temperature)
        groups = in_chunks(lambda chunk, shown: engine.sample(chunk, sampling, **shown), prompts, images, req)
        out[req.pass_k] = [any(hits(t, [s.ids for s in group])) for group, t in zip(groups, tasks, strict=True)]
    return out


def in_chunks(generate, prompts: list[list[int]], images: list[tuple[bytes, ...]], req: EvalRequest) -> list:
    """`generate(prompts, shown)` of each prompt, in their order, CHUNK prompts a call, stopping between
    two calls if the worker is asked to. A call's prompts have as many images each (what one batch
    of the engine's takes), `shown` {"images": theirs}, or {} for prompts without."""
    out: list = [None] * len(prompts)
    for count in sorted({len(shown) for shown in images}):
        at = [i for i, shown in enumerate(images) if len(shown) == count]
        for j in range(0, len(at), CHUNK):
            stop_if_asked(req)
            part = at[j:j + CHUNK]
            made = generate([prompts[i] for i in part], {"images": [images[i] for i in part]} if count else {})
            for i, m in zip(part, made, strict=True):
                out[i] = m
    return out


def report(r, keys: Keys, result: EvalResult, req: EvalRequest) -> dict:
    """Record the result (metrics stream, evals hash, evals file) and say it on the console."""
    entry = record_eval(r, keys, result, evals_path=req.evals_path)
    print(f"evaluator: version {req.version}: {result.summary()}", flush=True)
    return entry
