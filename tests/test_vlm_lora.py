"""LoRA on a vision-language model (the tiny random Idefics3, tests/harness/models.py `tiny_vlm`,
and where the HF engine samples it the tiny Qwen2-VL, `tiny_qwen2_vl`, its image tokens at 3-D
positions): adapters on its text model only (trainer/lora.py `towers`), published merged or as the
adapter alone, which the engines load and sample from with the pictures and the trainer's log-probs.
Run with -s to see the measured log-prob differences."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch

from common.checkpoints import ADAPTER_CONFIG, ADAPTER_FILE
from common.keys import PAYLOAD, Keys
from common.messages import encode
from common.models import ModelError
from engines.hf_engine import HFEngine
from tests.harness.adapters import TARGETS, adapted
from tests.harness.models import LOGPROB_TOL, tiny_qwen2_vl, tiny_vlm
from tests.harness.needs import need, need_vllm
from tests.harness.vlm import sampled_by_runs, sampled_groups, shapes_task, worst_gap
from trainer.checkpoints import load_model, write_checkpoint
from trainer.lora import apply_lora

# Each tiny VLM's parts beside its text model (its vision tower, Idefics3's connector), its text
# model's layers as the module names them, and as its checkpoint (the hub's layout) does.
TOWERS = {"idefics3": ("model.vision_model", "model.connector"), "qwen2_vl": ("model.visual",),
          "qwen2_5_vl": ("model.visual",)}
TEXT = {"idefics3": ".model.text_model.layers.", "qwen2_vl": ".model.language_model.layers.",
        "qwen2_5_vl": ".model.language_model.layers."}
HUB_TEXT = {"idefics3": "model.text_model.layers.", "qwen2_vl": "model.layers.", "qwen2_5_vl": "model.layers."}


@pytest.fixture(scope="module")
def vlm(tiny_model, tmp_path_factory) -> Path:
    return tiny_vlm(tiny_model, tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module", params=["idefics3", "qwen2_vl"])
def any_vlm(request, tiny_model, tmp_path_factory) -> tuple[str, Path]:
    """(kind, directory) of the tiny Idefics3 (`vlm`) or of the tiny Qwen2-VL or Qwen2.5-VL (3-D
    positions; vision blocks of `qkv`, `proj` and `fc1`, `fc2` or Qwen2.5-VL's `gate_proj`,
    `up_proj`, `down_proj`, as its text model's MLP names them)."""
    if request.param == "idefics3":
        return request.param, request.getfixturevalue("vlm")
    return request.param, tiny_qwen2_vl(tiny_model, tmp_path_factory.mktemp(request.param) / "model",
                                        kind=request.param)


def published_versions(vlm: Path, out: Path) -> tuple[torch.nn.Module, Path, Path]:
    """The VLM at `vlm` with trained-like adapters (q and v of its text model, B random) as the
    trainer holds it, and that version published under `out` merged and as the adapter alone."""
    model = adapted(vlm, seed=7)
    merged, _ = write_checkpoint(model, checkpoint_dir=out, step=1, source_dir=vlm)
    adapter, _ = write_checkpoint(model, checkpoint_dir=out, step=2, source_dir=vlm, adapter=True)
    return model, merged, adapter


@pytest.fixture(scope="module")
def versions(vlm, tmp_path_factory) -> tuple[torch.nn.Module, Path, Path]:
    """`published_versions` of the tiny Idefics3."""
    return published_versions(vlm, tmp_path_factory.mktemp("published"))


@pytest.fixture(scope="module")
def any_versions(any_vlm, tmp_path_factory) -> tuple[torch.nn.Module, Path, Path]:
    """`published_versions` of `any_vlm`."""
    return published_versions(any_vlm[1], tmp_path_factory.mktemp("published"))


@contextmanager
def prefill_positions(engine: HFEngine) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Within it, (input ids (B, T), positions (3, B, T): temporal, height, width) of each prefill of
    the engine's Qwen2-VL (base model, under peft's layers where it holds adapters) as its text model
    is given them, appended to the list it yields."""
    base = engine.model.get_base_model() if hasattr(engine.model, "get_base_model") else engine.model
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    ids: list[torch.Tensor] = []

    def inputs(_module, _args, kwargs):
        ids.append(kwargs["input_ids"])

    def positions(_module, _args, kwargs):
        given = kwargs["position_ids"]  # (4, B, T): 1-D text positions first, then the 3-D ones; or (3, B, T)
        if given.shape[-1] > 1:
            seen.append((ids[-1], given[-3:]))

    hooks = [base.model.register_forward_pre_hook(inputs, with_kwargs=True),
             base.model.language_model.register_forward_pre_hook(positions, with_kwargs=True)]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize(("any_vlm", "tower_only"), [
    pytest.param("idefics3", ["fc1", "out_proj"], id="idefics3"),
    pytest.param("qwen2_vl", ["qkv", "proj", "fc1", "fc2"], id="qwen2_vl"),
    pytest.param("qwen2_5_vl", ["qkv", "proj"], id="qwen2_5_vl"),
], indirect=["any_vlm"])
def test_lora_on_the_vlm_adapts_its_text_model_only(any_vlm, tower_only):
    """Target modules naming all seven projections of the text model's layers name modules of the
    vision tower too (Idefics3's q, k, v_proj; Qwen2.5-VL's gate, up, down_proj): the adapters go on
    the text model's alone, and the vision tower (and Idefics3's connector) stay frozen; target
    modules that only the vision tower has (`tower_only`: Qwen2-VL's qkv, proj, fc1, fc2) are left
    out beside the text model's, and refused alone, saying why."""
    kind, vlm = any_vlm
    towers = TOWERS[kind]
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    in_towers = {name.rsplit(".", 1)[-1] for name, m in load_model(vlm).named_modules()
                 if isinstance(m, torch.nn.Linear) and name.startswith(tuple(f"{t}." for t in towers))}
    assert in_towers & {*projections, *tower_only} == set(tower_only) | {  # the names the tower has too
        "idefics3": {"q_proj", "k_proj", "v_proj"}, "qwen2_vl": set(), "qwen2_5_vl": {"gate_proj", "up_proj",
                                                                                      "down_proj"}}[kind]
    model = apply_lora(load_model(vlm), rank=4, alpha=8.0, dropout=0.0, target_modules=projections)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * 7 * 2  # A and B of 7 projections in each of the text model's 2 layers
    assert all(TEXT[kind] in name and ".lora_" in name for name in trained), trained
    assert not any(".lora_" in name for name, _ in model.named_parameters() if any(t in name for t in towers))
    mixed = apply_lora(load_model(vlm), rank=4, alpha=8.0, dropout=0.0, target_modules=["v_proj", *tower_only])
    trained = [name for name, p in mixed.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * 2 and all(TEXT[kind] in name and ".v_proj.lora_" in name for name in trained), trained
    not_on = ", ".join(re.escape(t) for t in towers)
    with pytest.raises(ModelError, match=r"trainer\.lora\.target_modules: .*adapters go on its text model only, "
                                         rf"not on {not_on}"):
        apply_lora(load_model(vlm), rank=4, alpha=8.0, dropout=0.0, target_modules=tower_only)


def test_the_hf_engine_samples_a_vlm_lora_version_merged_and_as_adapter(any_vlm, any_versions):
    """An adapted VLM's version published merged (a whole Idefics3 or Qwen2-VL checkpoint, vision
    tower as it was) and as the adapter alone (text-model tensors only), each loaded into an HF
    engine on the tiny VLM: what it samples with the pictures has the adapted model's log-probs
    within LOGPROB_TOL, far from the base model's. On the Qwen2-VL the adapted text model is given
    the 3-D positions either way: each picture's 4 tokens on a 2 x 2 (height, width) grid."""
    import json

    from safetensors.torch import load_file

    kind, vlm = any_vlm
    model, merged, adapter = any_versions
    saved = load_file(str(adapter / ADAPTER_FILE))
    assert saved and all(TEXT[kind] in k for k in saved)
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["exclude_modules"]
    tasks, base = [shapes_task(i) for i in range(3)], load_model(vlm).eval()
    for published in (merged, adapter):
        engine = HFEngine(vlm, seed=0, max_batch=4)
        engine.load_weights(published, version=1)
        assert (engine.adapter is not None) == (published == adapter)
        with prefill_positions(engine) if kind != "idefics3" else nullcontext([]) as seen:
            groups = sampled_groups(engine, tasks, temperature=1.0)
        worst, tokens = worst_gap(model, groups, temperature=1.0, share_prompts=True)
        off = worst_gap(base, groups, temperature=1.0, share_prompts=True)[0]
        how = "adapter" if published == adapter else "merged"
        print(f"hf with the {kind}'s LoRA version {published.name} ({how}): behaviour vs trainer log-probs over "
              f"{tokens} tokens, max abs diff {worst:.2e} (the base model's "
              f"{off:.2e})")
        assert tokens >= 3 * 4 * 4 and worst < LOGPROB_TOL and off > 100 * LOGPROB_TOL
        if kind == "idefics3":
            continue
        assert seen and sum(ids.shape[0] for ids, _ in seen) == 3 * 4  # each completion's prompt prefilled once
        for ids, positions in seen:
            for row in range(ids.shape[0]):
                image = (ids[row] == model.config.image_token_id).nonzero().squeeze(1)
                first = int(positions[0, row, image[0]])
                assert len(image) == 4 and positions[:, row, image].tolist() == [
                    [first] * 4, [first, first, first + 1, first + 1], [first, first + 1, first, first + 1]]


@pytest.mark.slow
def test_vllm_samples_a_vlm_lora_adapter_version(vlm, versions):
    """vLLM on the tiny VLM opened with enable_lora loads the adapter version (text-model tensors
    only, as vLLM adapts a VLM's text model) and samples with the pictures and the adapted model's
    log-probs within LOGPROB_TOL."""
    from engines.choice import open_engine

    need_vllm()
    model, _, adapter = versions
    engine = open_engine("vllm", vlm, seed=0, lora_rank=4)
    try:
        engine.load_weights(adapter, version=2)
        groups = sampled_groups(engine, [shapes_task(i) for i in range(3)], temperature=1.0)
        worst, tokens = worst_gap(model, groups, temperature=1.0, share_prompts=True)
        off = worst_gap(load_model(vlm).eval(), groups, temperature=1.0, share_prompts=True)[0]
        print(f"vllm with the VLM's LoRA adapter: behaviour vs trainer log-probs over {tokens} tokens, max abs diff "
              f"{worst:.2e} (the base model's {off:.2e})")
        assert tokens >= 3 * 4 * 4 and worst < LOGPROB_TOL and off > 100 * LOGPROB_TOL
    finally:
        del engine


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_a_generator_pool_samples_each_runs_pictures_with_its_own_adapter(engine, vlm, versions, tmp_path):
    """Two runs' adapters on one engine over the tiny VLM, each run's requests through its RunEngine
    (generators/pool.py, as `python -m generators --runs a.toml,b.toml` wires them): the prompts
    with pictures of both runs, queued together, are each sampled with their own run's adapter and
    pictures, their behaviour log-probs those of that run's trainer model within LOGPROB_TOL, far
    from the other run's."""
    from common.config import GeneratorConfig
    from engines.choice import open_for_settings
    from generators.pool import run_engines

    need(engine)
    models = {"a": versions[0], "b": adapted(vlm, seed=8)}
    published = {"a": versions[2], "b": write_checkpoint(models["b"], checkpoint_dir=tmp_path, step=5, source_dir=vlm,
                                                         adapter=True)[0]}
    opened = HFEngine(vlm, seed=0, max_batch=4) if engine == "hf" else open_for_settings(
        "vllm", vlm, settings=GeneratorConfig.model_validate({"threads": 1}), dtype="float32", seed=0, max_running=8,
        lora_rank=4, adapters=2)
    try:
        runs = dict(zip(models, run_engines(opened, list(models)), strict=True))
        for version, (run, path) in enumerate(published.items(), start=3):
            runs[run].load_weights(path, version=version)
        assert [runs[run].version for run in models] == [3, 4]
        groups = sampled_by_runs(runs, [shapes_task(i) for i in range(3)], temperature=1.0)
        for run, other in (("a", "b"), ("b", "a")):
            worst, tokens = worst_gap(models[run], groups[run], temperature=1.0, share_prompts=True)
            off = worst_gap(models[other], groups[run], temperature=1.0, share_prompts=True)[0]
            print(f"{engine} pool on the tiny VLM, run {run}: behaviour vs its trainer's log-probs over {tokens} "
                  f"tokens, max abs diff {worst:.2e} (run {other}'s {off:.2e})")
            assert tokens >= 3 * 4 * 4 and worst < LOGPROB_TOL and off > 100 * LOGPROB_TOL
    finally:
        del opened


@pytest.mark.slow
@pytest.mark.parametrize("publish", ["merged", "adapter"])
def test_the_trainer_trains_a_vlms_lora_adapters_and_the_engine_follows(tmp_path, redis_url, r, any_vlm, publish):
    """The trainer process with [trainer.lora] on groups with pictures (the tiny Idefics3's, the tiny
    Qwen2-VL's): it trains the text model's adapters alone (the vision tower and connector published
    as they were) and publishes each version `publish`'s way; the HF engine loads the last one and
    samples with the log-probs of the trainer's model rebuilt from its saved state."""
    from safetensors.torch import load_file

    from tests.harness.pipeline import train_groups
    from trainer.schedule import build_scheduler
    from trainer.state import load_state

    kind, vlm = any_vlm
    run, rng = f"vl-{kind}-{publish}", random.Random(0)
    engine = HFEngine(vlm, seed=0, max_batch=4)
    for g in sampled_groups(engine, [shapes_task(rng.randrange(100), n=4) for _ in range(4)], temperature=1.0):
        r.xadd(Keys(run).samples, {PAYLOAD: encode(g)})
    lora = {"rank": 4, "alpha": 8.0, "target_modules": TARGETS, "publish": publish}
    train_groups(tmp_path, redis_url, vlm, run=run, max_steps=2, lr=0.05, lora=lora)

    trainer_model = apply_lora(load_model(vlm), rank=4, alpha=8.0, dropout=0.0, target_modules=TARGETS)
    trained = [p for p in trainer_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.05)
    load_state(trainer_model, optimizer, build_scheduler(optimizer, schedule="constant", warmup_steps=0,
                                                          total_steps=0),
               path=tmp_path / "out" / "trainer_state" / "step_2")
    assert len(optimizer.state) == len(trained) == 2 * 2 * 2  # A and B of q and v in 2 layers
    trainer_model.eval()
    published = tmp_path / "out" / "checkpoints" / "step_2"
    start = load_file(vlm / "model.safetensors")
    if publish == "merged":
        after = load_file(published / "model.safetensors")
        moved = sorted(k for k in start if not torch.equal(start[k], after[k]))
        assert after.keys() == start.keys() and moved
        assert all(k.startswith(HUB_TEXT[kind]) and k.endswith(("q_proj.weight", "v_proj.weight"))
                   for k in moved), moved
    else:
        assert sorted(p.name for p in published.iterdir()) == [ADAPTER_CONFIG, ADAPTER_FILE]
        assert all(TEXT[kind] in k for k in load_file(published / ADAPTER_FILE))
    engine.load_weights(published, version=2)
    groups = sampled_groups(engine, [shapes_task(i) for i in range(3)], temperature=1.0)
    worst, tokens = worst_gap(trainer_model, groups, temperature=1.0, share_prompts=True)
    print(f"trainer-published {kind} LoRA ({publish}) in the HF engine: max abs diff {worst:.2e} over {tokens} tokens")
    assert tokens > 0 and worst < LOGPROB_TOL


@pytest.mark.slow
def test_two_ranks_train_a_vlms_lora_adapters_as_one(tmp_path, redis_url, r, vlm):
    """The trainer under FSDP2 on gloo with [trainer.lora] on the VLM (built on `meta`, adapted
    there, each rank reading its own rows of the frozen weights): two ranks give the losses and the
    published adapter of one process, its tensors the text model's alone."""
    from safetensors.torch import load_file

    from tests.harness.configs import write_config
    from tests.harness.metrics import read_steps
    from tests.harness.pipeline import QUARANTINE_OFF, run_trainer

    engine = HFEngine(vlm, seed=0, max_batch=4)
    groups = sampled_groups(engine, [shapes_task(i) for i in range(8)], temperature=1.0)
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "publish": "adapter"}
    for name, nproc in (("one", 1), ("two", 2)):
        for g in groups:
            r.xadd(Keys(name).samples, {PAYLOAD: encode(g)})
        config = write_config(tmp_path / f"{name}.toml", run=name, redis_url=redis_url, output_dir=tmp_path / name,
                              model={"path": str(vlm), "dtype": "float32"}, base={},
                              rollout={"group_size": 4, "prompts_per_step": 4, "max_staleness": 2},
                              trainer={"max_steps": 2, "lr": 0.02, "micro_batch_size": 3, "threads": 1,
                                       "keep_checkpoints": 2, "lora": lora, **QUARANTINE_OFF})
        run_trainer(config, cwd=tmp_path, nproc=nproc)
    one, two = (read_steps(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["tokens/trained"] == b["tokens/trained"] > 0
    a, b = (load_file(tmp_path / n / "checkpoints" / "step_2" / ADAPTER_FILE) for n in ("one", "two"))
    assert a.keys() == b.keys() and all(".model.text_model." in k for k in a)
    same = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max(a[k].abs().max().item() for k in a if ".lora_B." in k)
    print(f"VLM LoRA adapters at world sizes 1 and 2: largest difference {same:.3g} (B moved by up to {moved:.3g})")
    assert same < 1e-5 and moved > 1e-4
