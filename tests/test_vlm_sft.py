"""SFT on conversations with images: an `sft` source's `image_column` (producers/sft.py), the trainer's
SFT step on the tiny VLM (tests/harness/models.py `tiny_vlm`) with the pictures' pixel values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.config import source_config
from common.images import image_messages, open_image, png_bytes
from common.keys import PAYLOAD, Keys
from common.messages import SampleGroup
from common.vision import load_processor
from producers.data import DataError, Source
from producers.main import admit
from producers.sft import conversation_group
from tasks import shapes
from tests.harness.models import tiny_vlm
from trainer.checkpoints import load_model
from trainer.samples import validate
from trainer.step import sft_step


@pytest.fixture(scope="module")
def vlm(tiny_model, tmp_path_factory) -> Path:
    return tiny_vlm(tiny_model, tmp_path_factory.mktemp("vlm") / "model")


def picture(index: int) -> tuple[bytes, int]:
    """The `index`-th shapes picture (PNG bytes) and how many shapes it holds."""
    problem = shapes.problem(seed=0, index=index)
    return png_bytes(shapes.picture(problem)), problem.answer


def chat(count: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "How many shapes are there?"},
            {"role": "assistant", "content": f"There are {count}."},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": f"Yes: {count}."}]


def processed(processor, messages: list[dict[str, str]], image: bytes | None) -> dict[str, torch.Tensor]:
    """The processor's inputs for the whole conversation as a user makes them with transformers: its
    chat template with the picture before the first user message's text, the picture's tokens laid
    out and its pixel values (none: `image` None)."""
    text = processor.apply_chat_template(image_messages(messages, 1), tokenize=False)
    return processor(text=[text], images=[[open_image(image)]] if image else None, add_special_tokens=False,
                     return_tensors="pt")


def hf_nll(model, inputs: dict[str, torch.Tensor], group: SampleGroup) -> float:
    """The mean NLL of `group`'s trained tokens (its completion's loss mask) by one HF forward pass of
    the VLM over the processor's `inputs`."""
    ids = inputs["input_ids"]  # (1, L)
    with torch.no_grad():
        logits = model(**inputs).logits[0, :-1].float()  # (L-1, V)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor([0] * len(group.prompt_ids) + list(group.completions[0].loss_mask), dtype=torch.float32)[1:]
    return float(-(logp * mask).sum() / mask.sum())


def test_an_sft_step_on_a_conversation_with_an_image_takes_the_loss_with_its_pixels(vlm):
    """A conversation with a picture becomes the processor's layout of the whole conversation (its
    image tokens in the prompt, before the first user message's text), and the trainer's SFT step
    takes the loss HF's own forward pass of the VLM gives with the processor's pixel values; the
    same group without its picture gives another loss."""
    from transformers import AutoModelForImageTextToText

    processor = load_processor(vlm)
    image, count = picture(0)
    messages = chat(count)
    group = conversation_group(processor.tokenizer, messages, group_id="c:0:0", images=(image,),
                               processor=processor)
    inputs = processed(processor, messages, image)
    want = hf_nll(AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval(), inputs, group)
    (c,) = group.completions
    assert group.images == (image,) and group.prompt_ids + list(c.ids) == inputs["input_ids"][0].tolist()
    assert group.prompt_ids.count(processor.tokenizer.convert_tokens_to_ids("<image>")) == 4
    trained = processor.tokenizer.decode([t for t, m in zip(c.ids, c.loss_mask, strict=True) if m])
    assert trained == f"There are {count}.<|im_end|>\nYes: {count}.<|im_end|>\n", trained

    def step_loss(g: SampleGroup) -> float:
        model = load_model(vlm)
        stats = sft_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [g], micro_batch_size=4,
                         micro_batch_tokens=0, max_grad_norm=1.0)
        assert stats.skipped == 0 and stats.tokens_trained == sum(c.loss_mask)
        return stats.loss

    got = step_loss(group)
    blind = step_loss(SampleGroup(**{**{f: getattr(group, f) for f in group.__slots__}, "images": ()}))
    print(f"SFT loss on the tiny VLM: trainer {got:.7f}, HF forward {want:.7f}; without the picture {blind:.7f}")
    assert got == pytest.approx(want, abs=1e-5)
    assert abs(blind - want) > 1e-4


def test_an_sft_source_names_its_image_column_and_a_few_steps_lower_the_loss(vlm, tmp_path, r):
    """An sft source's `image_column` (a path beside the data file): the producer writes each
    conversation's group with its picture, a row whose image is missing or not a PNG or JPEG is
    skipped saying why, a text model skips every conversation with a picture, and six SFT steps on
    the groups as the trainer reads them lower the assistant turns' NLL (HF's forward with the
    pictures)."""
    processor = load_processor(vlm)
    rows, pictures = [], {}
    for i in range(4):
        image, count = picture(i)
        (tmp_path / f"pic{i}.png").write_bytes(image)
        pictures[f"pic{i}.png"] = (image, count)
        rows.append({"messages": chat(count), "image": f"pic{i}.png"})
    (tmp_path / "notes.png").write_text("not a picture")
    rows = [{"messages": chat(1), "image": "missing.png"}, {"messages": chat(1), "image": "notes.png"}, *rows]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = source_config(name="chat", kind="sft", path=str(data), image_column="image", shuffle=False)
    keys = Keys("vsft")
    skipped = admit(r, keys, sources=[Source(config, seed=0, field="data.sources.0")], weights=[1.0], seed=0,
                    admitted=0, count=4, n=1, version=0, tokenizer=processor.tokenizer, processor=processor)
    reasons = [row.reason for _, row in skipped]
    assert len(reasons) == 2 and "cannot read the image" in reasons[0] and "missing.png" in reasons[0]
    assert "not a PNG or JPEG file" in reasons[1]
    groups = [validate(fields, vocab_size=len(processor.tokenizer), objective="sft")
              for _, fields in r.xrange(keys.samples)]
    assert [g.images for g in groups] == [(pictures[f"pic{i}.png"][0],) for i in range(4)]
    assert all(b"images" in fields[PAYLOAD] for _, fields in r.xrange(keys.samples))

    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(row) + "\n" for row in rows[2:]))
    text_model = Source(source_config(name="chat", kind="sft", path=str(good), image_column="image"), seed=0,
                        field="data.sources.0")
    with pytest.raises(DataError, match=r"no row makes a trainable conversation \(last: chat:1:\d: 1 images, but the "
                                        r"model takes no images \(not a vision-language model\)\)"):
        admit(r, Keys("text"), sources=[text_model], weights=[1.0], seed=0, admitted=0, count=1, n=1, version=0,
              tokenizer=processor.tokenizer, processor=None)

    model = load_model(vlm)
    inputs = [processed(processor, chat(count), image) for image, count in pictures.values()]

    def nll() -> float:
        model.eval()
        return sum(hf_nll(model, x, g) for x, g in zip(inputs, groups, strict=True)) / len(groups)

    before = nll()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = [sft_step(model, optimizer, groups, micro_batch_size=4, micro_batch_tokens=0, max_grad_norm=1.0).loss
              for _ in range(6)]
    after = nll()
    print(f"tiny VLM, 6 SFT steps on 4 conversations with pictures: assistant-token NLL {before:.3f} -> {after:.3f}; "
          f"step losses {', '.join(f'{x:.3f}' for x in losses)}")
    assert after < before - 1.0 and losses[-1] < losses[0]


@pytest.mark.slow
def test_a_short_sft_run_of_the_vlm_lowers_the_loss_on_conversations_with_pictures(vlm, tmp_path, redis_url, r):
    """Producer and trainer as OS processes (`trainer.objective = "sft"`, an sft source with
    `image_column`) on the tiny VLM: six steps, nothing dead-lettered, and the checkpoint's
    assistant-token NLL on the conversations, with their pictures, well below the initial model's."""
    from transformers import AutoModelForImageTextToText

    from tests.harness.configs import write_config
    from tests.harness.metrics import read_steps
    from tests.harness.processes import spawn, stop, wait_for

    processor = load_processor(vlm)
    rows, chats = [], []
    for i in range(4):
        image, count = picture(i)
        (tmp_path / f"pic{i}.png").write_bytes(image)
        rows.append({"messages": chat(count), "image": f"pic{i}.png"})
        chats.append((chat(count), image))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = write_config(tmp_path / "sft.toml", run="vsft", redis_url=redis_url, output_dir=tmp_path / "out", model=vlm,
                       base={}, rollout={"prompts_per_step": 4, "max_staleness": 1},
                       data={"sources": [{"name": "chat", "kind": "sft", "path": str(data), "image_column": "image"}]},
                       trainer={"objective": "sft", "lr": 3e-3, "max_steps": 6, "threads": 1, "micro_batch_size": 4})
    producer = spawn("producers", cwd=tmp_path, env=env, log=tmp_path / "producer.log")
    trainer = spawn("trainer", cwd=tmp_path, env=env, log=tmp_path / "trainer.log")
    try:
        wait_for(lambda: trainer.poll() is not None, timeout=600, what="the sft trainer's 6 steps", procs=[producer])
    finally:
        stop(trainer)
        stop(producer)
    assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()
    metrics = read_steps(tmp_path / "out" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["groups/dead"] == 0 for m in metrics)

    groups = [conversation_group(processor.tokenizer, m, group_id=str(i), images=(img,), processor=processor)
              for i, (m, img) in enumerate(chats)]
    inputs = [processed(processor, m, img) for m, img in chats]

    def nll(path: Path) -> float:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        return sum(hf_nll(model, x, g) for x, g in zip(inputs, groups, strict=True)) / len(groups)

    before, after = nll(vlm), nll(tmp_path / "out" / "checkpoints" / "step_6")
    print(f"tiny VLM, a 6-step SFT run (producer + trainer) on 4 conversations with pictures: assistant-token NLL "
          f"{before:.3f} -> {after:.3f}; loss first {metrics[0]['loss']:.3f} last {metrics[-1]['loss']:.3f}")
    assert after < before - 1.0
