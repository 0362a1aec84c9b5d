"""Vision-language RL on a Qwen2-VL and a Qwen2.5-VL: tiny random ones (tests/harness/models.py
`tiny_qwen2_vl`), whose image tokens sit at 3-D (M-RoPE) positions; the HF engine samples with the pictures and the
trainer's packed pass gives each sequence the positions the model gives it alone
(trainer/vision.py `mrope_positions`). Run with -s to see the measured log-prob differences."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from common.messages import Completion, PromptTask, SampleGroup
from engines.hf_engine import HFEngine
from tests.harness.models import LOGPROB_TOL, tiny_qwen2_vl
from tests.harness.vlm import sampled_groups, shapes_task, worst_gap
from trainer.checkpoints import load_model
from trainer.step import step_batches
from trainer.vision import mrope_positions, pixel_values_of


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_vl(request, tiny_model, tmp_path_factory) -> Path:
    return tiny_qwen2_vl(tiny_model, tmp_path_factory.mktemp(request.param) / "model", kind=request.param)


@pytest.fixture(scope="module")
def qwen_engine(qwen_vl) -> HFEngine:
    return HFEngine(qwen_vl, seed=0, max_batch=4)


def asking(index: int, more: str) -> PromptTask:
    """The `index`-th shapes problem with `more` after its question (prompts of other lengths)."""
    task = shapes_task(index)
    return PromptTask(**{**{f: getattr(task, f) for f in task.__slots__},
                         "messages": [{"role": "user", "content": task.messages[0]["content"] + more}]})


@pytest.mark.parametrize(("temperature", "share_prompts"), [(1.0, True), (0.7, False)])
def test_hf_engine_logprobs_agree_with_the_trainers_on_qwen2_vl(qwen_engine, qwen_vl, temperature, share_prompts):
    """Behaviour log-probs of completions the HF engine samples from the tiny Qwen2-VL with each
    prompt's picture (its `<|image_pad|>` tokens laid out by the processor: 4 a 32-pixel picture;
    prompts of three lengths, left-padded in one batch), against the trainer's packed pass over them
    with the same pictures: within LOGPROB_TOL on every token, as for text and Idefics3. With each
    other's pictures they are far off."""
    tasks = [asking(0, ""), asking(1, " Count them one by one, carefully."), asking(2, " Go.")]
    pad = qwen_engine.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [qwen_engine.prompt_ids(t).count(pad) for t in tasks] == [4, 4, 4]
    assert len({len(qwen_engine.prompt_ids(t)) for t in tasks}) == 3
    groups = sampled_groups(qwen_engine, tasks, temperature=temperature)
    model = load_model(qwen_vl).eval()
    worst, tokens = worst_gap(model, groups, temperature=temperature, share_prompts=share_prompts)
    print(f"hf on the tiny {model.config.model_type}, T={temperature}, share_prompts={share_prompts}: behaviour vs "
          f"trainer log-probs over {tokens} tokens, max abs diff {worst:.2e} (tolerance {LOGPROB_TOL:.0e})")
    assert tokens >= 3 * 4 * 4 and worst < LOGPROB_TOL
    swapped = [SampleGroup(**{**{f: getattr(g, f) for f in g.__slots__}, "images": groups[(i + 1) % 3].images})
               for i, g in enumerate(groups)]
    assert worst_gap(model, swapped, temperature=temperature, share_prompts=share_prompts)[0] > 100 * LOGPROB_TOL


def test_packed_qwen2_vl_sequences_get_the_3d_positions_the_model_gives_each_alone(qwen_engine, qwen_vl):
    """A packed micro-batch of two prompts' completions, shared prompts and not: each position's
    (temporal, height, width) position is the one the model's `get_rope_index` gives its sequence
    (prompt and completion) alone, the picture's tokens on a 2 x 2 grid (not 1-D), the text after
    it continuing from there."""
    groups = sampled_groups(qwen_engine, [shapes_task(i, n=2) for i in range(2)], temperature=1.0)
    model = load_model(qwen_vl).eval()
    core, token = model.model, model.config.image_token_id
    for share in (True, False):
        mb = step_batches(groups, micro_batch_size=8, micro_batch_tokens=0, pack=True,
                          share_prompts=share)[0].batches[0]
        packed = mb.packed
        grids = pixel_values_of(model, packed.images, device=torch.device("cpu"))["image_grid_thw"]
        got = mrope_positions(core, packed.ids, packed.position_ids, packed.docs, packed.segments == 0, grids, token)
        assert len(packed.images) == (2 if share else 4) and got.shape == (3, *packed.ids.shape)
        flat = packed.at.view(mb.input_ids.shape)  # (B, T): the packed position predicting each target
        for row, g in enumerate(groups[i] for i in range(2) for _ in range(2)):
            prompt = torch.tensor(g.prompt_ids)
            c = g.completions[row % 2]
            ids = torch.cat([prompt, torch.tensor(c.ids[:-1], dtype=torch.long)])[None]  # its inputs
            assert torch.equal(mb.input_ids[row, :ids.shape[1]], ids[0])
            types = torch.zeros_like(ids)
            types[0, :len(prompt)] = prompt == token
            alone, _ = core.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grids[:1])  # (3, 1, n)
            p, n = len(prompt), len(c.ids)
            where = flat[row, p - 1:p - 1 + n]  # its prompt's last token and its completion's inputs, packed
            assert torch.equal(got[:, 0, where], alone[:, 0, p - 1:p - 1 + n]), (share, row)
            image = (prompt == token).nonzero().squeeze(1)  # 4 tokens: a 2 x 2 grid from its first position
            first = int(image[0])
            assert alone[:, 0, image].tolist() == [[first] * 4, [first, first, first + 1, first + 1],
                                                   [first, first + 1, first, first + 1]]
            assert int(alone[0, 0, -1]) == ids.shape[1] - 1 - 2  # the grid of 4 took 2 positions


def test_vllm_refuses_qwen2_vl_without_torchvision(qwen_vl):
    """vLLM's Qwen2-VL model (which its Qwen2.5-VL's imports) imports transformers' torchvision image
    processor: without torchvision (this machine's packages) the vLLM engine refuses the model at
    once, saying so and naming the engine that samples it, where vLLM itself would fail its
    start-up "to inspect" the model."""
    import importlib.util

    from engines.vllm_engine import VLLMEngine

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: vLLM may serve Qwen2-VL")
    with pytest.raises(ValueError, match=r"vLLM serves a qwen2(_5)?_vl model only with torchvision installed.*"
                                         r"generator\.engine = \"hf\""):
        VLLMEngine(qwen_vl)


def test_the_trainer_refuses_a_vlm_whose_image_features_it_does_not_place():
    """A Qwen3-VL (other 3-D positions, its image features added at deeper layers too) is not trained
    with positions or features this trainer would get wrong: its pass is refused, naming the
    architectures it takes."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from common.models import ModelError
    from trainer.vision import showing

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    config = Qwen3VLConfig(
        text_config={"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "rope_parameters": rope},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 8, "num_position_embeddings": 16, "deepstack_visual_indexes": []},
        image_token_id=60)
    ids = torch.tensor([[1, 60, 60, 60, 60, 2, 3]])
    model = Qwen3VLForConditionalGeneration(config)
    named = r"Qwen3VLForConditionalGeneration: not a .* trainer places \(Idefics3, SmolVLM, Qwen2-VL, Qwen2\.5-VL\)"
    with pytest.raises(ModelError, match=named), \
            showing(model, ids, (b"picture",), torch.ones_like(ids, dtype=torch.bool),
                    position_ids=torch.arange(7)[None], docs=torch.zeros_like(ids)):
        pass


def test_a_sharded_qwen2_vl_shards_its_vision_blocks_and_saves_under_the_checkpoints_names(qwen_vl):
    """FSDP2 shards each block of the vision tower (`model.visual.blocks`) as the text model's, and a
    checkpoint written from the sharded model (each sharded module's class then `FSDP<Class>`, as
    `fully_shard` makes it) holds the names the model was read from (`model.layers`, `visual`), not
    the module's (`model.language_model.layers`, `model.visual`), as one process's does."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoConfig

    from common.vision import model_class
    from trainer.checkpoints import hf_tensors
    from trainer.parallel import vision_blocks

    # built from its config, as each rank builds it (trainer/loading.py `sharded_from_meta`)
    model = model_class(qwen_vl).from_config(AutoConfig.from_pretrained(qwen_vl))
    blocks = model.model.visual.blocks
    assert len(blocks) > 0 and vision_blocks(model) == list(blocks)
    hub = set(load_file(qwen_vl / "model.safetensors"))
    assert set(hf_tensors(model, model.state_dict(), None)) == hub
    state = model.state_dict()
    for m in [*blocks, *model.model.language_model.layers, model]:
        m.__class__ = type(f"FSDP{type(m).__name__}", (FSDPModule, type(m)), {})
    assert set(hf_tensors(model, state, None)) == hub
    assert type(model).__name__.startswith("FSDP")  # as sharded still, once saved


@pytest.mark.parametrize("transfer", ["disk", "tensors"])
def test_the_hf_engine_reloads_a_qwen2_vl_checkpoint_with_other_weights(qwen_engine, qwen_vl, tiny_model, tmp_path,
                                                                        transfer):
    """A checkpoint in the hub's layout (`model.layers`, `visual`: what the trainer writes, and
    broadcasts under those names with trainer.weight_transfer) loaded into a running engine
    between steps, from disk or from the tensors: it samples with the new weights (the trainer's
    log-probs over them agree within LOGPROB_TOL, the first weights' do not), and the first load back."""
    from safetensors.torch import load_file

    kind = json.loads((qwen_vl / "config.json").read_text())["model_type"]
    step = tiny_qwen2_vl(tiny_model, tmp_path / "step_1", seed=1, kind=kind)
    tasks = [shapes_task(i, n=2) for i in range(2)]
    first, new = load_model(qwen_vl).eval(), load_model(step).eval()
    try:
        if transfer == "disk":
            qwen_engine.load_weights(step, version=1)
        else:
            sent = load_file(step / "model.safetensors")
            assert any(k.startswith("model.layers.") for k in sent), "the checkpoint's names, not the module's"
            qwen_engine.load_tensors(sent, version=1)
        groups = sampled_groups(qwen_engine, tasks, temperature=1.0)
        worst = worst_gap(new, groups, temperature=1.0, share_prompts=True)[0]
        old = worst_gap(first, groups, temperature=1.0, share_prompts=True)[0]
        assert worst < LOGPROB_TOL and old > 100 * LOGPROB_TOL
    finally:
        qwen_engine.load_weights(qwen_vl, version=0)
    back = sampled_groups(qwen_engine, tasks, temperature=1.0)
    assert worst_gap(first, back, temperature=1.0, share_prompts=True)[0] < LOGPROB_TOL


def continued_after_an_update(engine, tasks: list[PromptTask], new: Path, *, back: Path,
                              switch: int = 3) -> list[SampleGroup]:
    """Each task's completions (10 tokens at most, T=1) as the generator writes them with
    generator.inflight_updates: the engine yields mid-completion (each completion holding `switch`
    sampled tokens; vLLM's steps are one token of each sequence), loads `new` as version 1 and
    continues each completion (prefilled again from its prompt, pictures and tokens so far) to its
    end; `back` is loaded again (version 0) after."""
    from engines.base import SamplingSettings
    from generators.inflight import group_versions

    prompts = {t.id: engine.prompt_ids(t) for t in tasks}
    tokens = 0

    def announced() -> bool:  # asked once per sampled token
        nonlocal tokens
        tokens += 1
        return tokens >= switch

    try:
        for t in tasks:
            engine.add(t.id, prompts[t.id], SamplingSettings(n=t.n, max_new_tokens=10, temperature=1.0),
                       images=t.images)
        if engine.name == "hf":
            finished = engine.step(yield_when=announced)
        else:
            finished = [done for _ in range(switch) for done in engine.step()]
        assert engine.has_unfinished()
        engine.load_weights(new, version=1)
        while engine.has_unfinished():
            finished += engine.step(yield_when=lambda: False)
    finally:
        engine.load_weights(back, version=0)
    done = {f.request_id: f.samples for f in finished}
    groups = []
    for t in tasks:
        version, spans = group_versions(done[t.id], added_at=0)
        groups.append(SampleGroup(id=t.id, prompt_id=t.id, prompt_ids=prompts[t.id], version=version, generator="g",
                                  engine="hf", images=t.images, completions=[
                                      Completion(ids=s.ids, logprobs=s.logprobs, reward=float(j), rewards={},
                                                 finish=s.finish, text="", versions=span)
                                      for j, (s, span) in enumerate(zip(done[t.id], spans, strict=True))]))
    return groups


def gaps_by_version(groups: list[SampleGroup], paths: dict[int, Path]):
    """The groups' packed micro-batch (prompts shared; one) and, under each version's weights
    (`paths`), the |trainer - behaviour| log-prob at each of its positions (B, T)."""
    from trainer.logprobs import sequence_logprobs
    from trainer.step import log_probs

    (mb, *_), = [step_batches(groups, micro_batch_size=8, micro_batch_tokens=0, pack=True,
                              share_prompts=True)[0].batches]
    assert mb.packed is not None and mb.packed.images
    gaps = {}
    with torch.no_grad():
        for version, path in paths.items():
            logp, _ = log_probs(partial(sequence_logprobs, temperature=1.0), load_model(path).eval(), mb)
            gaps[version] = (logp - mb.behaviour_logp).abs()
    return mb, gaps


def assert_each_token_is_its_versions(mb, gaps: dict[int, torch.Tensor]) -> None:
    """Every trained token's behaviour log-prob is the trainer's under the version that sampled it,
    within LOGPROB_TOL, and far from the other version's; each version sampled some."""
    trained = mb.mask > 0
    for version in (0, 1):
        own, other = trained & (mb.versions == version), trained & (mb.versions == 1 - version)
        print(f"version {version}: {int(own.sum())} tokens, max abs diff {gaps[version][own].max():.2e} "
              f"(tolerance {LOGPROB_TOL:.0e}), the other version's {gaps[1 - version][own].max():.2e}")
        assert int(own.sum()) >= 4, f"tokens sampled by version {version}"
        assert gaps[version][own].max() < LOGPROB_TOL, f"version {version}'s tokens: its log-probs"
        assert gaps[1 - version][own].max() > 100 * LOGPROB_TOL, "the other version's differ"
        assert other.any()


def test_a_vlm_completion_continued_after_an_inflight_update_keeps_its_pictures(qwen_engine, qwen_vl, tiny_model,
                                                                               tmp_path):
    """generator.inflight_updates on the HF engine and a VLM: the engine yields mid-completion (each
    completion holding 3 sampled tokens), loads another version, and continues each sequence
    with its pictures' pixel values and 3-D positions kept: every token's behaviour log-prob is the
    trainer's (with the pictures) under the version that sampled it, within LOGPROB_TOL, and
    far from the other version's."""
    kind = json.loads((qwen_vl / "config.json").read_text())["model_type"]
    step = tiny_qwen2_vl(tiny_model, tmp_path / "step_1", seed=1, kind=kind)
    groups = continued_after_an_update(qwen_engine, [shapes_task(i, n=2) for i in range(2)], step, back=qwen_vl)
    assert_each_token_is_its_versions(*gaps_by_version(groups, {0: qwen_vl, 1: step}))


# ------------------------------------------ completions that sample the image token themselves


def image_prone(model: Path, dst: Path, *, logit: float = 8.0) -> Path:
    """A copy of the tiny VLM at `model` that samples its image token (`<|image_pad|>`, `<image>`)
    often: its lm_head row for that token set to `logit` times the mean direction of the model's
    last hidden states over the shapes prompts with their pictures (a logit of about `logit` there,
    where the random model's others are near 0), every other weight the model's."""
    import shutil

    from safetensors.torch import load_file, save_file

    from common import vision

    shutil.copytree(model, dst)
    source = load_model(model).eval()
    processor, token = vision.load_processor(model), source.config.image_token_id
    states = []
    with torch.no_grad():
        for i in range(4):
            task = shapes_task(i)
            ids = torch.tensor([vision.prompt_ids(processor, task)])
            pixels = vision.pixel_inputs(processor, [task.images])
            if "image_grid_thw" in pixels:
                pixels["mm_token_type_ids"] = (ids == token).int()
            states.append(source(input_ids=ids, output_hidden_states=True, **pixels).hidden_states[-1][0])
    mean = torch.cat(states).mean(0)
    tensors = load_file(dst / "model.safetensors")
    tensors["lm_head.weight"][token] = logit * mean / mean.dot(mean)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def prone_versions(kind: str, tiny_model: Path, root: Path) -> tuple[Path, Path]:
    """The tiny Qwen2-VL (`kind` "qwen2_vl": 3-D positions) or Idefics3 ("idefics3": 1-D), and a
    second version of it (other random weights), each `image_prone`, under `root`."""
    from tests.harness.models import tiny_vlm

    build = partial(tiny_qwen2_vl, kind="qwen2_vl") if kind == "qwen2_vl" else tiny_vlm
    return tuple(image_prone(build(tiny_model, root / f"v{seed}", seed=seed), root / f"prone_v{seed}")
                 for seed in (0, 1))


@pytest.fixture(scope="module", params=["qwen2_vl", "idefics3"])
def prone(request, tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    return prone_versions(request.param, tiny_model, tmp_path_factory.mktemp(f"prone_{request.param}"))


@pytest.fixture(scope="module")
def prone_engine(prone) -> HFEngine:
    return HFEngine(prone[0], seed=0, max_batch=4)


def test_a_completion_that_samples_the_image_token_keeps_the_trainers_logprobs(prone, prone_engine):
    """A VLM completion may sample the image token itself: the engine embeds it as text, at a text
    position (decoding takes no pixels), and so does the trainer (trainer/vision.py fills the
    prompt's image tokens alone): every token's behaviour log-prob, the sampled image tokens' and
    those after them, is the trainer's within LOGPROB_TOL."""
    torch.manual_seed(0)  # the engine samples from torch's generator
    groups = sampled_groups(prone_engine, [shapes_task(i, n=2) for i in range(2)], temperature=1.0)
    token = prone_engine.model.config.image_token_id
    sampled = sum(c.ids[:-1].count(token) for g in groups for c in g.completions)
    assert sampled >= 2, "image tokens sampled (and fed again)"
    worst, tokens = worst_gap(load_model(prone[0]).eval(), groups, temperature=1.0, share_prompts=True)
    print(f"{prone_engine.model.config.model_type}: {tokens} tokens ({sampled} image tokens fed again), "
          f"max abs diff {worst:.2e}")
    assert tokens >= 20 and worst < LOGPROB_TOL


def test_a_completion_that_sampled_the_image_token_continues_after_an_inflight_update(prone, prone_engine):
    """generator.inflight_updates with completions that sample the image token before and after the
    switch: continued from prompt + tokens so far under the next version, an image token the
    completion sampled stays text (the prompt's image tokens alone take the pictures' features and,
    on Qwen2-VL, 3-D positions), as the trainer embeds it: every token's behaviour log-prob is the
    trainer's under the version that sampled it, within LOGPROB_TOL. (Counted as an image's place,
    the re-fed token took another picture's 3-D positions on Qwen2-VL, and left more image tokens than
    features on Idefics3: the continuation failed.)"""
    torch.manual_seed(0)
    check_image_tokens_continued(prone_engine, prone, prone_engine.model.config.image_token_id)


def check_image_tokens_continued(engine, versions: tuple[Path, Path], token: int) -> None:
    """`continued_after_an_update` of two shapes prompts x 2 from `versions` (0, then 1): some
    completion sampled the image token `token` before the switch and was continued, some sampled it
    after, and every token is its version's (`assert_each_token_is_its_versions`)."""
    groups = continued_after_an_update(engine, [shapes_task(i, n=2) for i in range(2)], versions[1],
                                       back=versions[0])
    mb, gaps = gaps_by_version(groups, dict(enumerate(versions)))
    image = (mb.mask > 0) & (mb.targets == token)
    refed = (image & (mb.versions == 0)).any(1) & ((mb.mask > 0) & (mb.versions == 1)).any(1)
    assert refed.any(), "a completion sampled the image token before the switch and was continued"
    assert (image & (mb.versions == 1)).any(), "the image token sampled after the switch"
    print(f"{engine.name}: image tokens sampled by version 0 {int((image & (mb.versions == 0)).sum())}, by "
          f"version 1 {int((image & (mb.versions == 1)).sum())}, {int(refed.sum())} completions continued past one")
    assert_each_token_is_its_versions(mb, gaps)


@pytest.mark.slow
def test_vllm_continues_a_completion_that_sampled_the_image_token_after_an_inflight_update(tiny_model, tmp_path):
    """The same on the vLLM engine and the tiny Idefics3 (vLLM serves no Qwen2-VL without torchvision):
    its reload preempts the running requests, which vLLM prefills again from prompt + tokens so far
    with the prompt's image features at the placeholder ranges it recorded when the request was
    added, a sampled image token as text: every token's behaviour log-prob is the trainer's under
    the version that sampled it, within LOGPROB_TOL."""
    from engines.choice import open_engine
    from tests.harness.needs import need

    need("vllm")
    versions = prone_versions("idefics3", tiny_model, tmp_path)
    engine = open_engine("vllm", versions[0], seed=0)
    check_image_tokens_continued(engine, versions, load_model(versions[0]).config.image_token_id)
