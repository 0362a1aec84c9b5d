"""`rollouts view`: the page over a run's groups, served by the real command against a real Redis
(groups written as a generator writes them) or a recording, read over plain HTTP and looked at in a
real headless Chromium."""

from __future__ import annotations

import contextlib
import dataclasses
import html
import json
import re
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.keys import Keys
from common.messages import Completion, SampleGroup, encode
from tests.harness.configs import write_config
from tests.harness.groups import xadd
from tests.harness.metrics import STEP
from tests.harness.needs import need_chromium
from tests.harness.processes import spawn, stop, wait_for
from tests.harness.servers import free_port

RECORDING = Path(__file__).resolve().parent / "data" / "tiny_pipeline.rec"
QUESTION = "What is 8 + 9? Answer with just the number."
RIGHT, WRONG = "The answer is 17.", "The answer is 12."
# rewards 1, 0, 1, 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5774, so GRPO's advantages are
# +-0.5 / 0.5774 = +-0.866 (trainer.advantage "grpo", the default)
ADVANTAGE = 0.5 / (1 / 3) ** 0.5
POSITIVE, NEGATIVE = (22, 163, 74), (220, 38, 38)  # the page's green and red at full strength (|advantage| 1.5)


def shade(base: tuple[int, int, int], advantage: float) -> tuple[int, int, int]:
    """White moved |advantage| / 1.5 of the way to `base`: how the page colours a trained token."""
    t = min(abs(advantage) / 1.5, 1.0)
    return tuple(round(255 + (b - 255) * t) for b in base)


def said(tok, text: str, *, logprob: float = -0.25) -> tuple[list[int], list[float]]:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids, [logprob] * len(ids)


def answer(tok, text: str, reward: float) -> Completion:
    ids, lps = said(tok, text)
    return Completion(ids=ids + [tok.eos_token_id], logprobs=lps + [-0.05], reward=reward,
                      rewards={"correct": reward}, finish="stop", text=text)


def write_groups(r, tok, run: str) -> None:
    """Three groups, as a generator writes them: the question answered right twice and wrong twice
    (by generator gen-a, weights v2); a group whose every answer is wrong (gen-b, v1); and an
    episode, the model's turns around the environment's."""
    prompt, _ = said(tok, tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                                  add_generation_prompt=True))
    right = SampleGroup(id="arithmetic:0:1", prompt_id="arithmetic:0:1", prompt_ids=prompt, version=2,
                        generator="gen-a", engine="hf",
                        completions=[answer(tok, t, float(t == RIGHT)) for t in (RIGHT, WRONG, RIGHT, WRONG)])
    wrong = dataclasses.replace(right, id="arithmetic:0:2", prompt_id="arithmetic:0:2", version=1, generator="gen-b",
                                completions=[answer(tok, WRONG, 0.0) for _ in range(4)])
    call, call_lps = said(tok, "What is 8 + 9?")
    result, _ = said(tok, "<|im_start|>user\n17<|im_end|>\n<|im_start|>assistant\n")
    final, final_lps = said(tok, "17")
    episode = Completion(ids=call + result + final, logprobs=call_lps + [0.0] * len(result) + final_lps, reward=1.0,
                         rewards={"correct": 1.0}, finish="stop", text="",
                         loss_mask=[1] * len(call) + [0] * len(result) + [1] * len(final))
    failed = dataclasses.replace(episode, reward=0.0, rewards={"correct": 0.0})
    episodes = dataclasses.replace(right, id="calc:0:3", prompt_id="calc:0:3", generator="gen-c",
                                   completions=[episode, failed])
    for g in (right, wrong, episodes):
        xadd(r, Keys(run), encode(g))


@contextlib.contextmanager
def viewing(tmp_path: Path, *args: str, env: dict[str, str]):
    """`rollouts view ... --port N` as a user starts it; yields the address it prints."""
    port = free_port()
    log = tmp_path / f"view-{port}.log"
    proc = spawn("common.cli", "view", "--port", str(port), *args, cwd=tmp_path, env=env, log=log)
    try:
        m = wait_for(lambda: re.search(r"at (http://127\.0\.0\.1:\d+/) \(Ctrl-C stops\)", log.read_text()),
                     timeout=120, what="rollouts view's address", procs=[proc])
        assert m[1] == f"http://127.0.0.1:{port}/"
        yield m[1], proc, log
    finally:
        stop(proc)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as reply:
        return reply.read().decode()


def sections(page: str) -> dict[str, str]:
    """Each group's part of the page, by group id."""
    return dict(re.findall(r'<section class="group" data-group-id="([^"]+)">(.*?)</section>', page, re.S))


def completions(section: str) -> list[dict]:
    """Each completion of a group's part: its advantage, its model turns' text (its token spans
    joined) and colours, and its environment turns' text."""
    out = []
    for adv, body in re.findall(r'<div class="completion" data-reward="[^"]*" data-advantage="([^"]*)">(.*?)'
                                r'</div>\s*</div>', section, re.S):
        turns = re.findall(r'<span class="turn (model|env)">(.*?)</span></span>', body, re.S)
        spans = {kind: [re.findall(r'<span class="tok" style="--a:([^;]*);--l:[^"]*" title="[^"]*">([^<]*)',
                                   text + "</span>") for k, text in turns if k == kind] for kind in ("model", "env")}
        out.append({"advantage": float(adv) if adv else None,
                    "text": ["".join(html.unescape(t) for _, t in turn) for turn in spans["model"]],
                    "colours": {c for turn in spans["model"] for c, _ in turn},
                    "env": ["".join(html.unescape(t) for _, t in turn) for turn in spans["env"]]})
    return out


def test_the_page_shows_the_runs_groups_token_by_token_and_its_filters_hide_groups(tmp_path, r, redis_url,
                                                                                    tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    write_groups(r, tok, "viewed")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text(
        json.dumps(dataclasses.replace(STEP, step=7, version=7, group_ids=["arithmetic:0:2"]).entry()) + "\n")
    env = write_config(tmp_path / "run.toml", run="viewed", redis_url=redis_url, model=tiny_model,
                       output_dir=tmp_path / "out")
    with viewing(tmp_path, env=env) as (url, proc, log):
        page = get(url)
        groups = sections(page)
        assert list(groups) == ["calc:0:3", "arithmetic:0:2", "arithmetic:0:1"]  # newest first
        assert html.escape(QUESTION) in groups["arithmetic:0:1"]
        assert "generator <b>gen-a</b>" in groups["arithmetic:0:1"] and "version <b>v2</b>" in groups["arithmetic:0:1"]
        assert "trained in step <b>7</b>" in groups["arithmetic:0:2"]
        shown = completions(groups["arithmetic:0:1"])
        assert [c["text"] for c in shown] == [[RIGHT + "<|im_end|>"], [WRONG + "<|im_end|>"]] * 2
        assert [c["advantage"] for c in shown] == pytest.approx([ADVANTAGE, -ADVANTAGE] * 2, abs=1e-4)
        assert shown[0]["colours"] == {"rgb({},{},{})".format(*shade(POSITIVE, ADVANTAGE))}
        assert shown[1]["colours"] == {"rgb({},{},{})".format(*shade(NEGATIVE, ADVANTAGE))}
        assert 'reward <b>1.000</b> (correct 1)' in groups["arithmetic:0:1"]
        # every answer wrong: advantage 0, tokens trained with it (white)
        assert [c["advantage"] for c in completions(groups["arithmetic:0:2"])] == [0.0] * 4
        # the episode: the model's two turns, the environment's between them shown as its own
        (won, lost) = completions(groups["calc:0:3"])
        assert won["text"] == ["What is 8 + 9?", "17"]
        assert won["env"] == ["<|im_start|>user\n17<|im_end|>\n<|im_start|>assistant\n"]
        assert [won["advantage"], lost["advantage"]] == pytest.approx([0.7071, -0.7071], abs=1e-4)  # 0.5 / sqrt(0.5)
        assert "episode: 2 model turns" in groups["calc:0:3"]

        # filters: the mean reward hides the all-wrong group, the generator and version pick one, the step its groups
        assert list(sections(get(url + "?min_reward=0.1"))) == ["calc:0:3", "arithmetic:0:1"]
        assert list(sections(get(url + "?max_reward=0"))) == ["arithmetic:0:2"]
        assert list(sections(get(url + "?generator=gen-a"))) == ["arithmetic:0:1"]
        assert list(sections(get(url + "?version=1"))) == ["arithmetic:0:2"]
        assert list(sections(get(url + "?step=7"))) == ["arithmetic:0:2"]
        assert list(sections(get(url + "?limit=1"))) == ["calc:0:3"]
        with pytest.raises(urllib.error.HTTPError, match="400"):
            get(url + "?min_reward=lots")

        # each load reads the stream afresh: emptied, it shows no group; Redis gone, it says so
        r.delete(Keys("viewed").samples)
        assert sections(get(url)) == {}
        r.shutdown(nosave=True)
        with pytest.raises(urllib.error.HTTPError, match="503") as gone:
            get(url)
        assert "rollouts view: cannot read the samples stream" in gone.value.read().decode()

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=60) == 0
    assert "rollouts view: stopped" in log.read_text()


def test_the_page_of_a_recording_shows_its_groups(tmp_path, tiny_model):
    env = write_config(tmp_path / "run.toml", run="elsewhere", model=tiny_model, output_dir=tmp_path / "out")
    with viewing(tmp_path, "--recording", str(RECORDING), env=env) as (url, _, _):
        page = get(url + "?limit=100")
    groups = sections(page)
    assert len(groups) == 20
    assert "20 groups read from the recording" in page
    assert all("generator <b>g1</b>" in g for g in groups.values())
    assert html.escape("What is 16 + 0? Answer with just the number.") in groups["arithmetic:0:19"]


def pixels_of(png: Path, rgb: tuple[int, int, int], *, within: int = 2) -> int:
    """How many pixels of the screenshot have colour `rgb` (each channel within `within`)."""
    import numpy as np
    from PIL import Image

    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    return int((np.abs(image - np.array(rgb)) <= within).all(axis=-1).sum())


def chromium(browser: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--force-device-scale-factor=1", *args], capture_output=True, text=True, timeout=120)


def test_a_browser_shows_the_right_answers_tokens_green_and_the_wrong_ones_red(tmp_path, r, redis_url, tiny_model):
    browser = need_chromium()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    write_groups(r, tok, "viewed")
    env = write_config(tmp_path / "run.toml", run="viewed", redis_url=redis_url, model=tiny_model)
    with viewing(tmp_path, env=env) as (url, _, _):
        dom = chromium(browser, "--dump-dom", url + "?generator=gen-a")
        assert dom.returncode == 0, dom.stderr[-3000:]
        shots = {}
        for colour in ("advantage", "logprob"):
            shots[colour] = tmp_path / f"{colour}.png"
            done = chromium(browser, f"--screenshot={shots[colour]}", "--window-size=1100,900",
                            url + f"?generator=gen-a&colour={colour}")
            assert done.returncode == 0 and shots[colour].is_file(), done.stderr[-3000:]
    # the browser's DOM holds a span per token: "The answer is 17." and the end of the turn
    (section,) = sections(dom.stdout).values()
    assert [c["text"] for c in completions(section)][0] == [RIGHT + "<|im_end|>"]
    tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in (RIGHT, WRONG, RIGHT, WRONG))
    assert len(re.findall(r'<span class="tok"', section)) == tokens
    # coloured by advantage, the right answers' tokens are green and the wrong ones' red, a line of
    # text's worth of each (2 completions of some 17 characters at 14 px)
    green, red = shade(POSITIVE, ADVANTAGE), shade(NEGATIVE, ADVANTAGE)
    assert pixels_of(shots["advantage"], green) > 2000 and pixels_of(shots["advantage"], red) > 2000
    # coloured by behaviour log-prob, neither
    assert pixels_of(shots["logprob"], green) == 0 and pixels_of(shots["logprob"], red) == 0


def test_a_character_split_over_tokens_is_shown_whole_and_turns_split_where_the_mask_changes(tiny_model):
    from viewer.groups import Token, texts, turns

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok("é 17", add_special_tokens=False)["input_ids"]  # é: two byte tokens, each alone U+FFFD
    assert tok.batch_decode([[i] for i in ids[:2]]) == ["\ufffd", "\ufffd"]
    assert texts(tok, ids) == ["é", "", *tok.batch_decode([[i] for i in ids[2:]])]
    assert texts(None, [5, 6]) == ["⟨5⟩", "⟨6⟩"]
    tokens = [Token(text=str(i), id=i, logprob=0.0, version=0, colour="", logprob_colour="") for i in range(5)]
    split = turns(tokens, [True, True, False, False, True])
    assert [(t.model, [x.id for x in t.tokens]) for t in split] == [(True, [0, 1]), (False, [2, 3]), (True, [4])]
    assert [(t.model, len(t.tokens)) for t in turns(tokens, None)] == [(True, 5)]
