"""What the benchmarks (ops/bench/) and the tests' harness (tests/harness/) both use to run the
project's pieces: its processes spawned and stopped (processes), a run's config file (configs),
prompts and sample groups written as the producer and a generator would (groups), checkpoints of
the tiny model and the trainer's log-probs under one (models), a `vllm serve` (servers). It
imports nothing of tests/, so a command of ops/ runs from a checkout without them."""
