"""How far a sampler's log-probs may honestly depart from the trainer's, by model.dtype: the bounds
`rollouts check` (checks/) judges a run's set-up by before it starts, and the trainer's quarantine
(trainer/quarantine.py) judges each generator by while it runs."""

# Bounds, by model.dtype: (mean |logp_trainer - logp_behaviour| over the sampled tokens, the
# largest exp(logp_trainer - logp_behaviour) of any one token). Measured on honest runs (engine and
# trainer on the same weights and temperature) on a 2-core CPU, 4 prompts x 4 completions
# (2026-11-25). float32, HF engine: the tiny test model mean 1.6e-7, max |log-ratio| 9.5e-7; the
# built-in SmolLM2-135M mean 4.2e-6, max 2.9e-5; vLLM's CPU engine on it mean 6.7e-6, max 5.4e-5.
# bfloat16 (the engine's bf16 weights against the trainer's float32 master weights under bf16
# autocast), HF engine, SmolLM2-135M: mean 0.033, ratio max 1.25; on an H200 (2026-11-26), the tiny
# model, HF engine on CUDA: mean 6.9e-4, ratio max 1.002 (SmolLM2 not measured on a GPU). Each bound
# sits far above its honest figure (float32: 1000x; bf16: 3x) and below what a wrong setting
# gives: on the tiny model, whose near-uniform distributions differ least, sampling at temperature
# 1.6 instead of 1.0 gives mean 0.049; other weights 0.18.
BOUNDS = {"float32": (0.01, 1.5), "bfloat16": (0.1, 3.0), "float16": (0.1, 3.0)}
