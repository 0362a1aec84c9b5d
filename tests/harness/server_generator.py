"""A generator process driving an inference server (generator.engine = "openai" on a `vllm serve`,
"sglang" on an SGLang server: ops/lib/servers.py), what tests/test_server_engine.py and
tests/test_sglang.py check alike."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.checkpoints import checksum_dir
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import WeightVersion, decode_group, encode
from tests.harness.groups import ask
from tests.harness.models import LOGPROB_TOL, perturbed_copy, publish_weights, reference_logprobs
from tests.harness.processes import spawn, stop, wait_for


def generator_drives_server(engine: str, server: str, model: Path, tmp_path: Path, redis_url: str, r, *,
                            timeout_s: float, meanwhile: Callable[[dict[str, str]], None] | None = None,
                            tol: float = LOGPROB_TOL) -> None:
    """A generator `g1` (generator.engine = `engine`, on the server at URL `server` serving `model`)
    samples a group of a prompt at version 0, then, once a perturbed copy of `model` is published as
    version 1, a group of a prompt admitted at version 1 under the new weights: their versions are 0
    and 1, their engine `engine`, and the second one's log-probs are the trainer's of the new weights
    within `tol`. `meanwhile(env)`, if given, runs while g1 holds the server, after its first group
    (`env`: the generator's environment, for another process); each wait lasts at most `timeout_s`."""
    run = f"drive-{engine}"
    keys = Keys(run)
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": run, "ROLLOUTS_MODEL__PATH": str(model),
           "ROLLOUTS_GENERATOR__ENGINE": engine, "ROLLOUTS_GENERATOR__SERVER_URL": server,
           "ROLLOUTS_ROLLOUT__GROUP_SIZE": "2", "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "6"}
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    g1 = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=tmp_path / "g1.log")
    try:
        r.xadd(keys.prompts, {PAYLOAD: encode(ask(0, n=2))})
        wait_for(lambda: r.xlen(keys.samples) >= 1, timeout=timeout_s, what="a group", procs=[g1])
        if meanwhile is not None:
            meanwhile(env)
        step_1 = perturbed_copy(model, tmp_path / "checkpoints" / "step_1", seed=1, scale=0.05)
        publish_weights(r, keys, WeightVersion(version=1, step=1, path=str(step_1), format="safetensors",
                                               checksums=checksum_dir(step_1), created_at=time.time()))
        # admitted at version 1: sampled with weights >= 1 (the generator reads weights:latest first)
        r.xadd(keys.prompts, {PAYLOAD: encode(dataclasses.replace(ask(1, n=2), admitted_at=1))})
        wait_for(lambda: r.xlen(keys.samples) >= 2, timeout=timeout_s, what="a second group", procs=[g1])
    finally:
        assert stop(g1) == 0, (tmp_path / "g1.log").read_text()[-3000:]
    first, second = (decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples))
    got = (first.engine, first.version, second.version)
    assert got == (engine, 0, 1), f"(engine, first version, second version): {got}, not {(engine, 0, 1)}"
    trainer = reference_logprobs(step_1)
    for c in second.completions:
        off = (torch.tensor(c.logprobs) - trainer(second.prompt_ids, c.ids, 1.0)).abs().max().item()
        assert off <= tol, f"version 1's log-probs off the trainer's by {off:.2e} (tolerance {tol:.0e}): {c}"
