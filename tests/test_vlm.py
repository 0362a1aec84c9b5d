"""Vision-language RL: a tiny random Idefics3 (SmolVLM's architecture; tests/harness/models.py
`tiny_vlm`), the synthetic visual task `shapes` (tasks/shapes.py), images on the wire
(common/images.py), the HF engine sampling with them and the trainer computing the same log-probs
from the same pictures (trainer/vision.py). Run with -s to see the measured log-prob differences."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import LimitsConfig, config_from_dict
from common.images import image_digest, open_image, png_bytes
from common.keys import PAYLOAD, Keys
from common.messages import Completion, MessageError, PromptTask, SampleGroup, decode_group, decode_prompt, encode
from common.models import ModelError
from engines.base import SamplingSettings, chat_prompt_ids
from engines.choice import open_engine
from engines.hf_engine import HFEngine
from tasks import shapes
from tests.harness.models import LOGPROB_TOL, tiny_vlm
from tests.harness.needs import need
from tests.harness.vlm import sampled_groups, shapes_task, worst_gap
from trainer.checkpoints import load_model
from trainer.logprobs import sequence_logprobs
from trainer.step import log_probs, step_batches


@pytest.fixture(scope="module")
def vlm(tiny_model, tmp_path_factory) -> Path:
    return tiny_vlm(tiny_model, tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def vlm_engine(vlm) -> HFEngine:
    return HFEngine(vlm, seed=0, max_batch=4)


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def any_engine(request, vlm, vlm_engine):
    """Each engine on the tiny VLM, loaded once for the module (vLLM takes a minute or two to start)."""
    if request.param == "hf":
        return vlm_engine
    need("vllm")
    return open_engine("vllm", vlm, seed=0)


def picture(colour: str = "red", size: int = 40) -> bytes:
    from PIL import Image

    return png_bytes(Image.new("RGB", (size, size), colour))


# ---------------------------------------------------------------------- the wire


def test_images_travel_with_the_prompt_and_the_group_and_bad_ones_are_refused():
    """A prompt's and a group's images come back byte for byte; a text message carries no images
    field; a decoder refuses a file that is not an image, a list too long or an image too big for
    [limits], naming which."""
    task = shapes_task(0)
    assert decode_prompt(encode(task)) == task and decode_prompt(encode(task)).images == task.images
    group = SampleGroup(id="g", prompt_id="g", prompt_ids=[1, 2], version=0, generator="t", engine="hf",
                        completions=[Completion(ids=[3], logprobs=[-0.5], reward=1.0, rewards={}, finish="stop",
                                                text="3")], images=(picture("red"), picture("blue")))
    back = decode_group(encode(group))
    assert back == group and back.images == group.images
    assert b"images" not in encode(SampleGroup(**{**{f: getattr(group, f) for f in group.__slots__}, "images": ()}))

    bad = PromptTask(**{**{f: getattr(task, f) for f in task.__slots__}, "images": (b"GIF89a not ours",)})
    with pytest.raises(MessageError, match=r"prompt shapes:0:0\.images\[0\]: not a PNG or JPEG file"):
        decode_prompt(encode(bad))
    with pytest.raises(MessageError, match=r"group g\.images: 2 images exceed the limit of 1"):
        LimitsConfig(max_images=1).decode_group(encode(group))
    big = picture("red", size=600)
    assert len(big) > 1024
    with pytest.raises(MessageError, match=rf"images\[0\]: {len(big)} bytes exceed the limit of 1024"):
        LimitsConfig(max_image_bytes=1024).decode_prompt(encode(PromptTask(
            **{**{f: getattr(task, f) for f in task.__slots__}, "images": (big,)})))


# ---------------------------------------------------------------------- the task


def shapes_drawn(image) -> int:
    """Cells of the shapes grid that hold a non-white pixel."""
    a = np.asarray(image)
    cell = a.shape[0] // shapes.GRID
    return sum(bool((a[r * cell:(r + 1) * cell, c * cell:(c + 1) * cell] < 250).any())
               for r in range(shapes.GRID) for c in range(shapes.GRID))


def test_the_shapes_task_draws_that_many_shapes_and_rewards_the_exact_count():
    """`[task] name = "shapes"` is a source of pictures drawn from the seed: each holds as many
    shapes as its answer says, the same index draws the same picture, the held-out split tells
    pictures apart although their text is the same, and the reward is 1 for the exact count only."""
    from tasks.rows import held_out, synthetic_prompt

    config = config_from_dict({"task": {"name": "shapes", "max_shapes": 6}})
    source = config.sources[0]
    assert source.kind == "shapes" and source.reward_name == "tasks.shapes:reward"
    prompts = [synthetic_prompt(source, seed=0, index=i, prompt_id=str(i)) for i in range(40)]
    for p in prompts:
        image = open_image(p.images[0])
        assert image.size == (48, 48) and shapes_drawn(image) == p.meta["answer"]
    assert {p.meta["answer"] for p in prompts} == set(range(1, 7))
    assert synthetic_prompt(source, seed=0, index=7, prompt_id="x").images == prompts[7].images
    assert len({image_digest(p.images[0]) for p in prompts}) == len(prompts)
    assert len({p.messages[0]["content"] for p in prompts}) == 1
    assert 0 < sum(held_out(p, 0.5) for p in prompts) < len(prompts)

    def score(text: str, answer: int) -> float:
        return shapes.reward(prompt="", completion=text, completion_ids=[], meta={"answer": answer})["correct"]

    assert score("There are 4", 4) == 1.0 and score("3, no: 4", 4) == 1.0  # the last number counts
    assert score("4, no: 3", 4) == 0.0 and score("40", 4) == 0.0 and score("none", 4) == 0.0


def test_a_data_set_names_its_image_column_as_paths_or_parquet_bytes(tmp_path):
    """`image_column` of a dataset source: a JSONL row's relative path is read beside the data file,
    a Parquet row's {bytes, path} cell (a `datasets` Image column) gives its bytes, a list gives them
    all in order; a row whose image is missing, not a PNG or JPEG, or over [limits] is skipped
    saying why, and a column the data set lacks stops the producer at start-up, named."""
    import json

    from datasets import Dataset, Features, Image, List, Value

    from common.config import ConfigError, source_config
    from producers.data import DataError, Source

    red, blue = (png_bytes(shapes.picture(shapes.problem(seed=0, index=i))) for i in (0, 1))
    assert red != blue
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "red.png").write_bytes(red)
    (tmp_path / "pics" / "blue.png").write_bytes(blue)
    (tmp_path / "pics" / "anim.gif").write_bytes(b"GIF89a" + bytes(40))
    rows = [{"q": "one", "image": "pics/red.png"}, {"q": "two", "image": ["pics/blue.png", "pics/red.png"]},
            {"q": "gone", "image": "pics/nope.png"}, {"q": "gif", "image": "pics/anim.gif"},
            {"q": "none", "image": None}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def source(path, max_images=8):
        return Source(source_config(name="v", kind="dataset", path=str(path), prompt_column="q",
                                    image_column="image", shuffle=False), seed=0, field="data.sources.0",
                      max_images=max_images)

    jsonl = source(tmp_path / "data.jsonl")
    made = [jsonl.take() for _ in rows]
    assert made[0].images == (red,) and made[0].messages == [{"role": "user", "content": "one"}]
    assert made[1].images == (blue, red)
    assert "cannot read the image" in made[2].reason and "nope.png" in made[2].reason
    assert "not a PNG or JPEG file" in made[3].reason
    assert made[4].reason == "column 'image' is empty"
    limited = source(tmp_path / "data.jsonl", max_images=1)
    assert [limited.take() for _ in range(2)][1].reason.endswith("2 images exceed the limit of 1")

    table = Dataset.from_dict({"q": ["a", "b"], "image": [{"bytes": blue, "path": None}, {"bytes": red, "path": None}]},
                              features=Features({"q": Value("string"), "image": Image()}))
    table.to_parquet(str(tmp_path / "data.parquet"))
    parquet = source(tmp_path / "data.parquet")
    assert [parquet.take().images for _ in range(2)] == [(blue,), (red,)]
    pair = Dataset.from_dict({"q": ["c"], "image": [[{"bytes": red, "path": None}, {"bytes": blue, "path": None}]]},
                             features=Features({"q": Value("string"), "image": List(Image())}))
    pair.to_parquet(str(tmp_path / "pair.parquet"))
    assert source(tmp_path / "pair.parquet").take().images == (red, blue)

    with pytest.raises(DataError, match=r"data.sources.0.image_column: column 'picture' is not in"):
        Source(source_config(name="v", kind="dataset", path=str(tmp_path / "data.jsonl"), prompt_column="q",
                             image_column="picture"), seed=0, field="data.sources.0")
    with pytest.raises(ConfigError, match="image_column.*needs chat = true"):
        config_from_dict({"data": {"sources": [{"name": "v", "kind": "dataset", "path": "x.jsonl",
                                                "prompt_column": "q", "image_column": "image", "chat": False}]}})


# ---------------------------------------------------------------------- engine and trainer


def test_the_engine_shows_the_picture_as_image_tokens_and_a_text_model_refuses_one(vlm_engine, tiny_model):
    """The VLM's prompt holds its processor's image tokens; a text model refuses a prompt with images,
    and so does an engine that samples text only (SGLang's: it lays out prompts with
    `chat_prompt_ids`), naming those that take them."""
    ids = vlm_engine.prompt_ids(shapes_task(0))
    image = vlm_engine.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image) == 4  # (32 px / 8 px patches / 2 shuffled)^2
    with pytest.raises(MessageError, match=r"prompt shapes:0:1: 1 images, but the model takes no images"):
        HFEngine(tiny_model, seed=0).prompt_ids(shapes_task(1))
    with pytest.raises(MessageError, match=r"prompt shapes:0:1: 1 images, but this engine samples text only "
                                           r"\(generator\.engine = \"hf\", \"vllm\" or \"openai\""):
        chat_prompt_ids(vlm_engine.tokenizer, shapes_task(1))


@pytest.mark.parametrize(("temperature", "share_prompts"), [(1.0, True), (0.7, False)])
def test_engine_logprobs_agree_with_the_trainers_on_the_vlm(any_engine, vlm_engine, vlm, share_prompts,
                                                           temperature):
    """Behaviour log-probs of completions an engine samples from the tiny VLM with each prompt's
    picture (HF: through the processor; vLLM: its multimodal inputs, the prompt's image tokens laid
    out as the HF engine lays them), against the trainer's packed pass over them with the same
    pictures (prompts of the same text but another picture are not shared): within LOGPROB_TOL on
    every token, as for text. The pictures matter: with each other's, the trainer's log-probs are far
    off."""
    tasks = [shapes_task(i) for i in range(3)]
    assert [any_engine.prompt_ids(t) for t in tasks] == [vlm_engine.prompt_ids(t) for t in tasks]
    groups = sampled_groups(any_engine, tasks, temperature=temperature)
    model = load_model(vlm).eval()
    worst, tokens = worst_gap(model, groups, temperature=temperature, share_prompts=share_prompts)
    print(f"{any_engine.name} on the tiny VLM, T={temperature}, share_prompts={share_prompts}: behaviour vs trainer "
          f"log-probs over {tokens} tokens, max abs diff {worst:.2e} (tolerance {LOGPROB_TOL:.0e})")
    assert tokens >= 3 * 4 * 4 and worst < LOGPROB_TOL
    swapped = [SampleGroup(**{**{f: getattr(g, f) for f in g.__slots__}, "images": groups[(i + 1) % 3].images})
               for i, g in enumerate(groups)]
    assert worst_gap(model, swapped, temperature=temperature, share_prompts=share_prompts)[0] > 100 * LOGPROB_TOL


def test_the_trainer_refuses_right_padded_rows_with_images(vlm_engine, vlm):
    """Right-padded micro-batches (trainer.pack_sequences = false) say not where each prompt's image
    tokens are: the trainer refuses them with images, naming the setting."""
    groups = sampled_groups(vlm_engine, [shapes_task(5, n=2)], temperature=1.0)
    mb = step_batches(groups, micro_batch_size=4, micro_batch_tokens=0, pack=False)[0].batches[0]
    assert mb.images == groups[0].images * 2
    with pytest.raises(ModelError, match=r"packed micro-batches only \(trainer\.pack_sequences = true"):
        log_probs(partial(sequence_logprobs, temperature=1.0), load_model(vlm), mb)


def test_a_step_makes_each_micro_batchs_pixel_values_once_for_all_its_passes(vlm_engine, vlm, monkeypatch):
    """A step of two updates with a proximal pass and a reference model's (three passes over each
    micro-batch) runs the image processor once for each micro-batch that holds pictures, not
    once a pass, and its passes see those pictures: the trainer's log-probs of
    the fresh samples agree with the engine's within LOGPROB_TOL."""
    import trainer.vision
    from common.config import GrpoLoss
    from trainer.step import GrpoOptions, train_step

    groups = sampled_groups(vlm_engine, [shapes_task(i, n=2) for i in range(2)], temperature=1.0)
    made = []

    def counted(processor, images, **kw):
        made.append(tuple(images))
        return real(processor, images, **kw)

    real = trainer.vision.pixel_inputs
    monkeypatch.setattr(trainer.vision, "pixel_inputs", counted)
    model, ref = load_model(vlm), load_model(vlm).eval().requires_grad_(False)
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), groups, ref_model=ref, how=GrpoOptions(
        loss=GrpoLoss(correction="decoupled", kl_coef=0.1), estimator="grpo", overlong="none", overlong_penalty=0.0,
        micro_batch_size=2, micro_batch_tokens=0, updates=2, max_grad_norm=1.0))
    assert stats.skipped == 0 and stats.tokens_trained > 0
    assert len(made) == len(groups)  # one micro-batch a group, one processor call each
    assert sorted(made) == sorted([(g.images,) for g in groups])
    assert stats.mismatch_max < LOGPROB_TOL


def test_the_viewer_shows_the_picture_beside_the_completions():
    """`rollouts view`'s page holds each group's pictures, byte for byte, as images beside its
    completions; a text group's shows none."""
    import base64
    import re

    from starlette.testclient import TestClient

    from viewer.app import make_app
    from viewer.groups import Advantages, Loaded

    task = shapes_task(2)
    completions = [Completion(ids=[5, 6], logprobs=[-0.1, -0.2], reward=float(j), rewards={}, finish="stop", text="")
                   for j in range(2)]
    seen = SampleGroup(id="vl", prompt_id=task.id, prompt_ids=[1, 2, 3], version=0, generator="g", engine="hf",
                       completions=completions, images=task.images)
    text = SampleGroup(**{**{f: getattr(seen, f) for f in seen.__slots__}, "id": "text", "images": ()})
    app = make_app(load=lambda: Loaded(groups=[("1-0", seen), ("2-0", text)], undecodable=0, source="test"),
                   tokenizer=None, how=Advantages(), metrics=None, run="vlm")
    page = TestClient(app).get("/").text
    sections = {part.split('"', 1)[0]: part for part in page.split('<section class="group" data-group-id="')[1:]}
    shown = re.findall(r'<img class="picture" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', sections["vl"])
    assert [base64.b64decode(s) for s in shown] == list(task.images)
    assert "<img" not in sections["text"]


# ---------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm", "hf-qwen2_vl", "hf-qwen2_5_vl"])
def test_the_vlm_trains_on_shapes_through_the_pipeline(tmp_path, redis_url, r, vlm, tiny_model, engine):
    """Producer, a generator (HF's engine, or vLLM's with the pictures as its multimodal inputs and
    each version reloaded in place) and the trainer as OS processes on the tiny VLM and the shapes task:
    each group carries its prompt's picture, every step trains, the tokens sampled by the weights
    the trainer holds differ from its own log-probs (computed with those pictures) by no more than
    LOGPROB_TOL (without them they differ by about 0.1), and each
    checkpoint is an Idefics3 with its processor beside it, which the engine loads and samples from.
    "hf-qwen2_vl", "hf-qwen2_5_vl": the same on the tiny Qwen2-VL and Qwen2.5-VL (3-D positions; vLLM
    refuses them without torchvision)."""
    from tests.harness.configs import write_config
    from tests.harness.models import tiny_qwen2_vl
    from tests.harness.pipeline import Pipeline, keep_groups, metrics

    if engine == "vllm":
        need("vllm")
    architecture = "Idefics3ForConditionalGeneration"
    if engine in ("hf-qwen2_vl", "hf-qwen2_5_vl"):
        kind = engine.removeprefix("hf-")
        engine, vlm = "hf", tiny_qwen2_vl(tiny_model, tmp_path / kind, kind=kind)
        architecture = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[kind]
    steps = 3
    env = write_config(tmp_path / "run.toml", run="vlm", redis_url=redis_url, output_dir=tmp_path / "run",
                       model=vlm, task={"name": "shapes"},
                       generator={"engine": engine, "batch_prompts": 2, "threads": 1},
                       trainer={"max_steps": steps, "lr": 1e-3, "micro_batch_size": 8, "threads": 1,
                                "keep_checkpoints": 2})
    pipe = Pipeline(tmp_path, env)
    keep_groups(r, Keys("vlm"))  # the trainer would trim what it trained
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    pipe.finish(timeout=600)  # vLLM's start-up on a loaded machine included
    groups = [decode_group(f[PAYLOAD]) for _, f in r.xrange(Keys("vlm").samples)]
    assert groups and all(g.images == shapes_task(int(g.prompt_id.rsplit(":", 1)[1])).images for g in groups)
    seen = metrics(tmp_path)
    assert [m["step"] for m in seen] == list(range(1, steps + 1))
    fresh = [m["mismatch/by_staleness"]["0"] for m in seen if "0" in m["mismatch/by_staleness"]]
    print("mismatch of tokens sampled by the trainer's own weights:", [f"{x:.2e}" for x in fresh])
    assert fresh and max(fresh) < LOGPROB_TOL
    last = tmp_path / "run" / "checkpoints" / f"step_{steps}"
    assert type(load_model(last)).__name__ == architecture
    assert (last / "processor_config.json").is_file()
    engine = HFEngine(last, seed=0)
    task = shapes_task(3, n=1)
    engine.add("a", engine.prompt_ids(task), SamplingSettings(n=1, max_new_tokens=4, temperature=1.0),
               images=task.images)
    assert engine.step()[0].samples[0].ids


# ---------------------------------------------------------------------- FSDP at world size 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["idefics3", "qwen2_vl", "qwen2_5_vl"])
def test_two_ranks_train_the_vlm_as_one(tmp_path, redis_url, r, vlm_engine, vlm, tiny_model, kind):
    """The trainer process under FSDP2 on gloo on groups with pictures: two ranks (each transformer
    block of the text model and of the vision tower sharded, each rank making the pixel values of
    its own micro-batches) give the losses, gradient norms and weights of one process, as on the
    dense model (tests/test_trainer_fsdp.py); the vision tower's weights moved, so its gradients
    went through the sharded pass too. On the tiny Idefics3 and on the tiny Qwen2-VL and Qwen2.5-VL
    (its tower `model.visual`, its blocks `blocks`, its text positions 3-D)."""
    from safetensors.torch import load_file

    from tests.harness.metrics import assert_same_grad_norms, read_steps
    from tests.harness.models import tiny_qwen2_vl
    from tests.harness.pipeline import run_ranks

    engine, tower = vlm_engine, "vision_model"
    if kind != "idefics3":
        vlm = tiny_qwen2_vl(tiny_model, tmp_path / kind, kind=kind)
        engine, tower = HFEngine(vlm, seed=0, max_batch=4), "visual"
    groups = sampled_groups(engine, [shapes_task(i) for i in range(8)], temperature=1.0)
    for name in ("one", "two"):
        for g in groups:
            r.xadd(Keys(name).samples, {PAYLOAD: encode(g)})
    run_ranks(tmp_path, "one", redis_url, vlm, nproc=1)
    assert "2 rank(s)" in run_ranks(tmp_path, "two", redis_url, vlm, nproc=2)
    one, two = (read_steps(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["tokens/trained"] == b["tokens/trained"] > 0
    assert_same_grad_norms(one, two)
    a, b = (load_file(tmp_path / n / "checkpoints" / "step_2" / "model.safetensors") for n in ("one", "two"))
    start = load_file(vlm / "model.safetensors")
    assert a.keys() == b.keys() == start.keys()  # the hub's layout, vision tower included
    same = max((a[k] - b[k]).abs().max().item() for k in a)
    vision = max((a[k] - start[k]).abs().max().item() for k in a if tower in k)
    print(f"largest parameter difference between world sizes 1 and 2: {same:.3g}; "
          f"the vision tower moved by up to {vision:.3g}")
    assert same < 1e-5 and vision > 1e-4
    assert (tmp_path / "two" / "checkpoints" / "step_2" / "processor_config.json").is_file()


# ---------------------------------------------------------------------- a new version's weights


def test_an_engine_samples_from_a_reloaded_vlm_checkpoint(any_engine, vlm, tiny_model, tmp_path):
    """A VLM checkpoint with other weights (another seed's: the vision tower's and connector's too)
    loaded into a running engine (load_weights, as between steps): what it samples from then on
    with the pictures has the new weights' log-probs, within LOGPROB_TOL of the trainer's over that
    checkpoint, and far from the first weights'; loading the first weights back gives theirs again.
    The checkpoint is gone while the engine samples (as the trainer deletes old ones,
    `keep_checkpoints`): the engine reads nothing from it once loaded (vLLM pointed its model config
    there, and loaded the processor from there again for the next picture)."""
    step = tiny_vlm(tiny_model, tmp_path / "step_1", seed=1)
    tasks = [shapes_task(i) for i in range(3)]
    first, new = load_model(vlm).eval(), load_model(step).eval()
    try:
        any_engine.load_weights(step, version=1)
        step.rename(tmp_path / "gone")
        groups = sampled_groups(any_engine, tasks, temperature=1.0)
        (tmp_path / "gone").rename(step)  # the trainer's side reads the processor from it
        worst, tokens = worst_gap(new, groups, temperature=1.0, share_prompts=True)
        old = worst_gap(first, groups, temperature=1.0, share_prompts=True)[0]
        print(f"{any_engine.name} reloaded with another VLM checkpoint: behaviour vs trainer log-probs over {tokens} "
              f"tokens, max abs diff {worst:.2e} (against the first weights' {old:.2e})")
        assert tokens >= 3 * 4 * 4 and worst < LOGPROB_TOL and old > 100 * LOGPROB_TOL
    finally:
        any_engine.load_weights(vlm, version=0)
    back = sampled_groups(any_engine, tasks, temperature=1.0)
    assert worst_gap(first, back, temperature=1.0, share_prompts=True)[0] < LOGPROB_TOL


def test_opening_the_engine_reads_the_models_config_once(vlm, monkeypatch):
    """The HF engine's class choice and its processor check (and any later caller) share one
    reading of the VLM's config.json (common/vision.py `is_vision_model`)."""
    from pathlib import Path

    from common import vision

    config, reads, read_text = (Path(vlm) / "config.json").resolve(), [], Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        reads.append(self) if self.resolve() == config else None, read_text(self, *a, **k))[1])
    vision.vision_config_at.cache_clear()  # as at start-up
    engine = HFEngine(vlm, seed=0, max_batch=1)
    assert engine.processor is not None and vision.is_vision_model(vlm) and len(reads) == 1, reads


# ---------------------------------------------------------------------- episodes


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_generator_plays_episodes_with_the_prompts_picture(engine, tmp_path, redis_url, r, vlm, vlm_engine):
    """A source with an environment on the tiny VLM: each model turn of an episode is sampled with
    the prompt's picture (its image tokens at the start of every turn's ids; vLLM given them as its
    multimodal inputs again), the group carries the picture, and the trainer's log-probs over the
    whole episode, computed with it, are the behaviour log-probs on the model's turns (within
    LOGPROB_TOL); with another prompt's picture they are far off."""
    from tests.harness.vlm import picture_episodes

    need(engine)
    tasks, groups = picture_episodes(tmp_path, r, redis_url, vlm, generator={"engine": engine})
    for g, t in zip(groups, tasks, strict=True):
        assert list(g.prompt_ids) == vlm_engine.prompt_ids(t)  # the picture's tokens laid out as the processor does
        for c in g.completions:
            assert c.text.count("turn 0: 12 + 34") == 1 and c.text.count("turn 1: 12 + 34") == 1
    model = load_model(vlm).eval()
    for share in (True, False):
        worst, tokens = worst_gap(model, groups, temperature=1.0, share_prompts=share)
        print(f"{engine}: episodes with pictures, share_prompts={share}: trainer vs behaviour log-probs over "
              f"{tokens} model tokens, max abs diff {worst:.2e}")
        assert tokens >= 3 * 2 * 3 and worst < LOGPROB_TOL
    swapped = [SampleGroup(**{**{f: getattr(g, f) for f in g.__slots__}, "images": groups[(i + 1) % 3].images})
               for i, g in enumerate(groups)]
    assert worst_gap(model, swapped, temperature=1.0, share_prompts=True)[0] > 100 * LOGPROB_TOL
