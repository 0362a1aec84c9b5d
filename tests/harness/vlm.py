"""Vision-language helpers the VLM tests share: the shapes task's prompts as the producer writes
them, groups an engine samples with their pictures, a generator process's episodes with them, and
the trainer's worst log-prob gap over them."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from common.messages import Completion, PromptTask, SampleGroup
from engines.base import SamplingSettings
from tasks import shapes
from trainer.logprobs import sequence_logprobs
from trainer.step import log_probs, step_batches


def shapes_task(index: int, *, n: int = 4) -> PromptTask:
    """The `index`-th shapes problem as the producer writes it."""
    question, meta, images = shapes.make_prompt(shapes.Options(), seed=0, index=index)
    return PromptTask(id=f"shapes:0:{index}", messages=[{"role": "user", "content": question}], text=None,
                      meta=meta, n=n, admitted_at=0, source="shapes", images=tuple(images))


def sampled_groups(engine, tasks: list[PromptTask], *, temperature: float) -> list[SampleGroup]:
    """Each task's completions as the generator writes them, its images carried (rewards alternating,
    so that every completion trains)."""
    return sampled_by_runs({"": engine}, tasks, temperature=temperature)[""]


def sampled_by_runs(engines: dict, tasks: list[PromptTask], *, temperature: float) -> dict[str, list[SampleGroup]]:
    """`sampled_groups` of each run's engine (a generator pool's RunEngines over one engine, by run):
    every run's requests queued before any is stepped, then each run's engine stepped in turn."""
    ids = {t.id: next(iter(engines.values())).prompt_ids(t) for t in tasks}
    for engine in engines.values():
        for t in tasks:
            engine.add(t.id, ids[t.id], SamplingSettings(n=t.n, max_new_tokens=12, temperature=temperature),
                       images=t.images)
    done: dict[str, dict] = {run: {} for run in engines}
    while any(engine.has_unfinished() for engine in engines.values()):
        for run, engine in engines.items():
            if engine.has_unfinished():
                done[run].update((f.request_id, f.samples) for f in engine.step())
    return {run: [SampleGroup(id=t.id, prompt_id=t.id, prompt_ids=ids[t.id], version=0, generator="test",
                              engine="hf", completions=[Completion(ids=s.ids, logprobs=s.logprobs,
                                                                   reward=float(j % 2), rewards={}, finish=s.finish,
                                                                   text="")
                                                        for j, s in enumerate(done[run][t.id])],
                              images=t.images) for t in tasks]
            for run in engines}


def worst_gap(model, groups: list[SampleGroup], *, temperature: float, share_prompts: bool) -> tuple[float, int]:
    """The largest |trainer - behaviour| log-prob over the groups' trained tokens, and their count."""
    batches = step_batches(groups, micro_batch_size=5, micro_batch_tokens=0, pack=True,
                           share_prompts=share_prompts, model=model)[0].batches  # the trainer's packing
    worst, tokens = 0.0, 0
    with torch.no_grad():
        for mb in batches:
            assert mb.packed is not None and mb.packed.images
            logp, _ = log_probs(partial(sequence_logprobs, temperature=temperature), model, mb)
            worst = max(worst, ((logp - mb.behaviour_logp).abs() * mb.mask).max().item())
            tokens += int(mb.mask.sum())
    return worst, tokens


def picture_episodes(tmp_path: Path, r, redis_url: str, vlm: Path, *, generator: dict, run: str = "vep",
                     ) -> tuple[list[PromptTask], list[SampleGroup]]:
    """Three shapes prompts (two completions each) played as 3-turn episodes (the Echo environment)
    by a generator process of `generator`'s settings on the VLM `vlm`: the tasks, and the groups it
    wrote (by id, each completion's reward set to alternate, so that every one trains), after
    checking each is a 3-turn episode with the environment's turns masked out."""
    from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
    from common.messages import decode_group, encode
    from tests.harness.configs import write_config
    from tests.harness.processes import spawn, stop, wait_for

    keys = Keys(run)
    write_config(tmp_path / "run.toml", run=run, redis_url=redis_url, model=vlm, base={},
                 rollout={"max_new_tokens": 5, "temperature": 1.0},
                 generator={"threads": 1, "env_workers": 1, **generator},
                 data={"sources": [{"name": "shapes", "kind": "shapes", "environment": "tests.env_fixtures:Echo",
                                    "max_turns": 3}]})
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    tasks = [shapes_task(i, n=2) for i in range(3)]
    for t in tasks:
        r.xadd(keys.prompts, {PAYLOAD: encode(t)})
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env={"ROLLOUTS_CONFIG": str(tmp_path / "run.toml")},
                 log=log)
    try:
        wait_for(lambda: r.xlen(keys.samples) >= 3, timeout=600, what="3 groups", procs=[proc])
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    groups = sorted((decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples)), key=lambda g: g.id)
    assert [g.images for g in groups] == [t.images for t in tasks]
    for g in groups:
        for c in g.completions:  # three model turns between the environment's two
            assert c.finish == "turns" and c.loss_mask is not None and 0 in c.loss_mask
    return tasks, [SampleGroup(**{**{f: getattr(g, f) for f in g.__slots__},
                                  "completions": [Completion(**{**{f: getattr(c, f) for f in c.__slots__},
                                                                "reward": float(j % 2)})
                                                  for j, c in enumerate(g.completions)]}) for g in groups]
