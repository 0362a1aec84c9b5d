"""The trainer's metrics.jsonl as the tests read it (one line a step, TRL's names), and a step's
metrics to write where a test needs one."""

from __future__ import annotations

from common.audit import last_trained, read_steps, trained_twice  # noqa: F401 (the harness's)
from common.metrics import PolicyStats, StepMetrics

POLICY = PolicyStats(loss=0.1, kl=0.0, clip_low=0.0, clip_high=0.01, clip_region=0.01, ratio=1.0, tis=1.0)
STEP = StepMetrics(step=1, version=1, reward_mean=0.1, reward_std=0.2, accuracy=0.1, frac_reward_zero_std=0.0,
                   reward_errors=0, mean_length=11.0, max_length=20, clipped_ratio=0.25, staleness_mean=1.0,
                   staleness_max=1,
                   policy=POLICY, sft_loss=None, entropy=0.9, grad_norm=1.0, lr=1e-5, dropped_stale=0, dead=0,
                   duplicate=0, tokens_trained=100.0, tokens_per_s=70.0, time_step=13.5, time_wait_data=0.5,
                   time_train=12.0, time_publish=1.0, generators_alive=1.0, generators_tokens_per_s=40.0,
                   group_ids=["a:0:0"], reward_components={"correct": (0.1, 0.3), "format": (0.5, 0.0)})


REL_GRAD_NORM = 1e-5  # largest relative difference of a step's gradient norm between world sizes


def assert_same_grad_norms(one: list[dict], two: list[dict]) -> None:
    """The gradient norms (before clipping) the trainer logged at each step are those of one
    process. The weights alone would not show a gradient scaled on some ranks: AdamW's update
    does not change with the gradient's scale, and clipping hides it. Up to float32 summation
    order: between 9e-8 and 3e-7 measured (2026-11-24, both tests, two steps each), against 0.5
    for a gradient halved on world size 2."""
    for a, b in zip(one, two, strict=True):
        rel = abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
        print(f"step {a['step']}: grad_norm {a['grad_norm']:.9g} (1 rank) {b['grad_norm']:.9g} (2 ranks), "
              f"relative difference {rel:.3g}")
        assert a["grad_norm"] > 0 and rel < REL_GRAD_NORM, (a["step"], a["grad_norm"], b["grad_norm"])
