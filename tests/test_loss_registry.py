"""A loss and an off-policy correction are each added in one file (issue 41, item 3): the config
takes them by type with their own options, --help lists them, and the trainer's step runs them.
The files are written into a copy of the checkout, and what sees them runs there."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from common import config

# trainer/losses/toy.py: the whole of adding a loss.
TOY_LOSS = '''\
"""toy: a test's loss, the correction-weighted policy gradient times `scale`."""

from __future__ import annotations

from pydantic import Field

from common.config import ClippedLoss
from trainer.losses import LossInputs, LossOutputs, LossStats
from trainer.losses.clipped import aggregate, prepare


class Options(ClippedLoss):
    # What the toy loss multiplies its policy gradient by.
    scale: float = Field(1.0, gt=0.0)


def loss(x: LossInputs, cfg: Options) -> LossOutputs:
    p = prepare(x, cfg)
    per_token = -cfg.scale * p.weight * p.adv * x.logp
    return LossOutputs(aggregate(per_token, p, x, "token_mean"),
                       LossStats(tis=((p.weight * p.mask).sum() / x.total_tokens).item()))
'''

# trainer/losses/corrections/toy_weight.py: the whole of adding a correction.
TOY_CORRECTION = '''\
"""toy_weight: a test's correction, the same weight on every token."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from common.config import CorrectionOptions


class Options(CorrectionOptions):
    # The weight of every token.
    value: float = Field(1.0, ge=0.0)


def weight(log_w: Tensor, mask: Tensor, cfg: Options) -> Tensor:
    return torch.full_like(log_w, cfg.value)
'''

# Run in the copy: what a user of the two new files sees.
USE = '''\
import argparse, os, random, sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import ConfigError, add_config_flags, config_from_dict
from tests.harness.groups import make_group
from trainer.step import GrpoOptions, train_step

import common.config
assert common.config.__file__.startswith(os.getcwd()), common.config.__file__  # the copy's, not the checkout's

table = {"type": "toy", "scale": 2.0, "correction": {"type": "toy_weight", "value": 0.25}}
loss = config_from_dict({"trainer": {"loss": table}}).trainer.loss
assert (loss.type, loss.scale, loss.clip_high, loss.correction.type, loss.correction.value) == \\
    ("toy", 2.0, 0.2, "toy_weight", 0.25), loss
assert config_from_dict({"trainer": {"loss": "toy"}}).trainer.loss.scale == 1.0  # by its type alone
with pytest.raises(ConfigError, match=r"trainer\\.loss\\.correction\\.value: Input should be greater than or equal"):
    config_from_dict({"trainer": {"loss": {"type": "toy", "correction": {"type": "toy_weight", "value": -1}}}})
with pytest.raises(ConfigError, match=r"trainer\\.loss\\.scale: unknown field for type 'grpo'"):
    config_from_dict({"trainer": {"loss": {"scale": 2.0}}})

parser = argparse.ArgumentParser()
add_config_flags(parser)
shown = " ".join(parser.format_help().split())
for want in ("--trainer.loss.type {cispo,custom,grpo,gspo,toy}",
             '"toy" (a test\\'s loss, the correction-weighted policy gradient times `scale`)',
             "--trainer.loss.scale float What the toy loss multiplies its policy gradient by.",
             "--trainer.loss.correction.value float The weight of every token.",
             '"toy_weight" (a test\\'s correction, the same weight on every token)'):
    assert want in shown, want

torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
group = make_group(model.config.vocab_size, "g", version=0, rng=random.Random(0), shape=(4, [3, 5, 4, 2]))


def step(loss):
    how = GrpoOptions(loss=loss, estimator="grpo", overlong="none", overlong_penalty=0.0, micro_batch_size=4,
                      micro_batch_tokens=0, updates=1, max_grad_norm=1.0)
    return train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [group], how=how)


twice = step(loss)
once = step(config_from_dict({"trainer": {"loss": {**table, "scale": 1.0}}}).trainer.loss)
assert twice.policy.tis == 0.25 and once.policy.tis == 0.25, (twice.policy, once.policy)  # the toy weight
assert once.loss != 0 and abs(twice.loss - 2 * once.loss) < 1e-6 * abs(once.loss), (twice.loss, once.loss)
print("toy loss and correction ran")
'''


def test_a_loss_and_a_correction_added_in_one_file_each_are_configured_by_type_and_trained_with(
        checkout, tiny_model):
    (checkout / "trainer" / "losses" / "toy.py").write_text(TOY_LOSS)
    (checkout / "trainer" / "losses" / "corrections" / "toy_weight.py").write_text(TOY_CORRECTION)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(USE), str(tiny_model)], cwd=checkout,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "toy loss and correction ran" in done.stdout, done.stderr[-3000:]


def test_an_options_class_that_cannot_be_read_alone_is_refused_naming_its_file_and_what_is_wrong(tmp_path, monkeypatch):
    folder = tmp_path / "trainer" / "losses"
    folder.mkdir(parents=True)
    monkeypatch.setattr(config, "_trainer_root", lambda: tmp_path)
    for name in ("toy_unread", "toy_based"):  # what reading them registers goes with the test
        monkeypatch.setitem(sys.modules, f"common.config:trainer/losses/{name}.py", None)
    (folder / "toy_unread.py").write_text('"""toy_unread: a constant of its own."""\n\nimport torch\n\n'
                                          "from common.config import LossOptions\n\nSCALE = 2.0\n\n\n"
                                          "class Options(LossOptions):\n    scale: float = SCALE\n")
    with pytest.raises(ImportError, match=r"trainer/losses/toy_unread\.py: its Options class uses 'SCALE', which it "
                                          r"does not import from common, pydantic, typing"):
        config._read_options("losses", config.LossOptions, suffix="Loss", default="toy_unread")
    (folder / "toy_unread.py").unlink()
    (folder / "toy_based.py").write_text('"""toy_based: not a loss\'s options."""\n\nfrom pydantic import BaseModel\n'
                                         "\n\nclass Options(BaseModel):\n    scale: float = 2.0\n")
    with pytest.raises(TypeError, match=r"trainer/losses/toy_based\.py: Options must subclass common\.config's "
                                        r"LossOptions"):
        config._read_options("losses", config.LossOptions, suffix="Loss", default="toy_based")
