"""The evaluator on a vision-language checkpoint (evaluator/jobs.py): held-out problems with images
(a data set's `image_column`, the `shapes` task) scored with their pictures on the tiny VLM
(tests/harness/models.py `tiny_vlm`), and a text model refusing them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.checkpoints import checksum_dir
from common.config import config_from_dict
from common.evals import eval_request
from common.images import image_messages, open_image, png_bytes
from common.messages import MessageError, WeightVersion
from common.vision import load_processor
from evaluator import jobs
from tasks import shapes
from tasks.rows import eval_prompts
from tests.harness.models import tiny_vlm
from tests.harness.needs import need

MAX_NEW_TOKENS = 5
TEMPERATURE = 0.02  # pass@k's (vLLM takes none below 0.01): each greedy token MARGIN above the next, sampled as greedy
MARGIN = 1.0  # in logits: a sample leaves the greedy token with probability below exp(-50) at TEMPERATURE


@pytest.fixture(scope="module")
def vlm(tiny_model, tmp_path_factory) -> Path:
    """The tiny VLM with its lm_head 10^4 times larger: the same greedy answers, each token's logit
    far enough above the next (a gap of 1e-4 becomes 1) for a sample at
    TEMPERATURE to be the greedy answer."""
    from transformers import AutoModelForImageTextToText

    path = tiny_vlm(tiny_model, tmp_path_factory.mktemp("vlm") / "model")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    model.save_pretrained(path, safe_serialization=True)
    return path


def plain(colour: str) -> bytes:
    """A picture of one colour (PNG bytes): the tiny VLM's greedy answer to a question changes with it."""
    from PIL import Image

    return png_bytes(Image.new("RGB", (32, 32), colour))


def said_by_hand(model, processor, question: str, images: list[bytes]) -> str:
    """The model's greedy answer to `question` shown `images`, as a user works it out: the
    processor's chat template with the pictures before the question, their pixel values, and
    transformers' own generate; each of its tokens at least MARGIN above the next (so that a
    sample at TEMPERATURE is the greedy answer)."""
    text = processor.apply_chat_template(image_messages([{"role": "user", "content": question}], len(images)),
                                         tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[open_image(i) for i in images]], add_special_tokens=False,
                       return_tensors="pt")
    eos = model.generation_config.eos_token_id
    eos = sorted({processor.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos,
                             pad_token_id=processor.tokenizer.pad_token_id, output_logits=True,
                             return_dict_in_generate=True)
    top2 = torch.stack(out.logits)[:, 0].topk(2, dim=-1).values  # (T, 2)
    assert (top2[:, 0] - top2[:, 1]).min() > MARGIN, f"a greedy token within {MARGIN} of the next: {top2}"
    return processor.tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def request(model: Path, sources: list[dict], *, engine: str = "hf", version: int = 1, prompts: int = 7):
    cfg = config_from_dict({"run": "vev", "rollout": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE},
                            "generator": {"engine": engine, "threads": 1},
                            "eval": {"every": 1, "prompts": prompts, "pass_k": 2, "sources": sources}})
    wv = WeightVersion(version=version, step=version, path=str(model), format="safetensors",
                       checksums=checksum_dir(model), created_at=0.0)
    return eval_request(cfg, wv)


def pictures_source(tmp_path: Path, model, processor) -> tuple[dict, float]:
    """A data set of seven questions, one with two pictures and six with one (paths in `image_column`),
    whose `said` column holds the greedy answer the model gives by hand to five of them (a hit)
    and, to the other two, that of another picture (a miss); and the pass@1 that makes."""
    question = "How many shapes are there?"
    colours = ("red", "green", "blue", "black", "white", "yellow")
    for i, colour in enumerate(colours):
        (tmp_path / f"pic{i}.png").write_bytes(plain(colour))
    shown = [["pic0.png", "pic1.png"]] + [[f"pic{i}.png"] for i in range(len(colours))]  # the two first
    said = [said_by_hand(model, processor, question, [(tmp_path / f).read_bytes() for f in files])
            for files in shown]
    assert len(set(said)) >= 4, f"the picture hardly changes the model's greedy answer: {said}"
    rows = []
    for i, files in enumerate(shown):
        wrong = next((s for s in said if s != said[i]), None) if i in (4, 5) else None
        rows.append({"question": question, "image": files if len(files) > 1 else files[0],
                     "said": said[i] if wrong is None else wrong})
    data = tmp_path / "pictures.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    source = {"name": "pictures", "path": str(data), "template": "{question}", "image_column": "image",
              "meta_columns": ["said"], "reward": "tests.reward_fixtures:says"}
    return source, 5 / 7


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_the_evaluator_scores_problems_with_pictures_on_a_vlm_checkpoint(engine, vlm, tmp_path, monkeypatch):
    """Held-out problems with images are scored with their pictures: on a data set whose answers are
    the VLM's own greedy answers worked out by hand with transformers (the processor's pixel values),
    pass@1 is the share of them that hold the model's answer, whatever order the problems come in,
    and so is pass@2 (sampled at a temperature where every sample is the greedy answer); on the
    `shapes` task's held-out problems, it is what the task's reward gives the answers by hand."""
    from transformers import AutoModelForImageTextToText

    need(engine)
    monkeypatch.setattr(jobs, "_ENGINE", {})  # no engine of another module's checkpoint
    processor = load_processor(vlm)
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    pictures, want = pictures_source(tmp_path, model, processor)
    shapes_source = {"name": "shapes", "kind": "shapes"}
    req = request(vlm, [pictures, shapes_source], engine=engine)
    result = jobs.evaluate(req)
    problems = eval_prompts(jobs.source_config(req.sources[1]), count=req.prompts, seed=req.seed, holdout=None)
    by_hand = [shapes.reward(prompt="", completion=said_by_hand(model, processor, p.messages[0]["content"],
                                                                list(p.images)),
                             completion_ids=[], meta=p.meta)["correct"] for p in problems]
    print(f"evaluator ({engine}) on the tiny VLM: pictures pass@1 {result.by_source['pictures'][1]:.3f} "
          f"pass@2 {result.by_source['pictures'][2]:.3f} "
          f"(by hand {want:.3f}), shapes pass@1 {result.by_source['shapes'][1]:.3f} "
          f"(by hand {sum(by_hand) / len(by_hand):.3f})")
    assert result.prompts == 14
    assert result.by_source["pictures"][1] == result.by_source["pictures"][2] == pytest.approx(want)
    assert result.by_source["shapes"][1] == pytest.approx(sum(by_hand) / len(by_hand))


def test_a_text_model_refuses_problems_with_pictures_naming_the_source(tiny_model, tmp_path, monkeypatch):
    """A checkpoint that takes no images fails the evaluation of a source with pictures, naming the
    source, the problem and why (as the generator dead-letters such a prompt)."""
    monkeypatch.setattr(jobs, "_ENGINE", {})
    (tmp_path / "pic.png").write_bytes(png_bytes(shapes.picture(shapes.problem(seed=0, index=0))))
    data = tmp_path / "pictures.jsonl"
    data.write_text(json.dumps({"question": "How many shapes?", "image": "pic.png"}) + "\n")
    source = {"name": "pictures", "path": str(data), "template": "{question}", "image_column": "image"}
    with pytest.raises(MessageError, match=r"evaluator: source 'pictures': prompt eval:pictures:0: 1 images, "
                                           r"but the model takes no images \(not a vision-language model\)"):
        jobs.evaluate(request(tiny_model, [source], prompts=1))


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_the_evaluator_scores_a_vlm_lora_adapter_version_as_its_weights_merged(engine, vlm, tmp_path,
                                                                              monkeypatch):
    """A VLM run that publishes its LoRA adapters alone (trainer.lora.publish = "adapter"): the
    evaluator loads the adapter onto its base VLM and scores problems with pictures with it. On a
    data set whose answers are the adapted model's own greedy answers worked out by hand, pass@1
    and pass@2 of the adapter version are the share that holds them, as are those of the same
    weights published merged (evaluated first, by the same evaluator: the adapter goes on the base
    model, not on the merged weights); the base model's answers by hand make another share."""
    from transformers import AutoModelForImageTextToText

    from tests.harness.adapters import adapted
    from trainer.checkpoints import write_checkpoint

    need(engine)
    monkeypatch.setattr(jobs, "_ENGINE", {})
    processor = load_processor(vlm)
    model = adapted(vlm, seed=7)
    with torch.no_grad():  # B a tenth of `adapted`'s: on this lm_head, the picture still changes the answer
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.mul_(0.1)
    merged, _ = write_checkpoint(model, checkpoint_dir=tmp_path / "ckpt", step=1, source_dir=vlm)
    adapter, _ = write_checkpoint(model, checkpoint_dir=tmp_path / "ckpt", step=2, source_dir=vlm, adapter=True)
    pictures, want = pictures_source(tmp_path, model, processor)
    base = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (tmp_path / "pictures.jsonl").read_text().splitlines()]
    base_said = [said_by_hand(base, processor, row["question"], [(tmp_path / f).read_bytes() for f in
                                                                  (row["image"] if isinstance(row["image"], list)
                                                                   else [row["image"]])]) for row in rows]
    base_want = sum(s == row["said"] for s, row in zip(base_said, rows, strict=True)) / len(rows)
    assert base_want != want, "the adapter hardly changes the model's greedy answers"
    got = {}
    if engine == "hf":  # vLLM opened on full weights is opened again for adapters: nothing to show there
        got["merged"] = jobs.evaluate(request(merged, [pictures], engine=engine, version=1)).by_source["pictures"]
    got["adapter"] = jobs.evaluate(request(adapter, [pictures], engine=engine, version=2)).by_source["pictures"]
    print(f"evaluator ({engine}) on the tiny VLM's LoRA version: {got} (by hand {want:.3f}, the base model's "
          f"{base_want:.3f})")
    for by_k in got.values():
        assert by_k[1] == by_k[2] == pytest.approx(want)
