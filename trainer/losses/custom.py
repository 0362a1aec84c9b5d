"""custom: a loss of your own, a "module:function" taking (inputs, **kwargs).

`function(inputs: trainer.losses.LossInputs, **kwargs) -> LossOutputs`, given behaviour_clip's
inputs (no proximal or reference pass: prox_logp and ref_logp None).
"""

from __future__ import annotations

import importlib
from functools import partial

from pydantic import Field

from common.config import LossOptions
from trainer.losses import Loss


class Options(LossOptions):
    # "module:function" (as rewards are named); loaded at start-up.
    function: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    # Keyword arguments passed to it ([trainer.loss.kwargs]).
    kwargs: dict[str, float | int | bool | str] = Field({})


def bind(cfg: Options) -> Loss:
    """`cfg.function` with its kwargs bound; ValueError if it cannot be loaded or is not callable."""
    module_name, _, attr = cfg.function.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"trainer.loss.function {cfg.function!r} cannot be loaded: {err}") from None
    if not callable(fn):
        raise ValueError(f"trainer.loss.function {cfg.function!r} is not callable")
    return partial(fn, **cfg.kwargs)
