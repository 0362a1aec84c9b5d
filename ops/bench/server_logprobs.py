"""How far the server engine's behaviour log-probs are from the trainer's, per batch shape.

    .venv/bin/python ops/bench/server_logprobs.py [--url URL --model DIR] [--requests 1 4 16]
        [--n 1 4] [--tokens 8 128] [--repeats 3] [--temperature 0.7] [--scales 0.05 0.5]

For each shape (`--requests` concurrent requests, each of `--n` completions of up to `--tokens`
new tokens), `--repeats` rounds of the same distinct chat prompts go to the server at once through
the server engine (engines/openai_engine.py: one HTTP request per thread, batched by the server as
they arrive; the rounds after the first, and a request's n completions, read the prompt's KV from
the prefix cache, as a GRPO group does). Each sampled token's log-prob is compared with the
trainer's (float32, the sequence alone, `trainer.grpo.token_logprobs`, as
tests/test_server_engine.py computes it), and the table gives the largest and the mean
|difference| over the shape's tokens: on the served weights, then on each perturbed copy
(ops/lib/models.py's `perturbed_copy`, as the tests make one: seed 1, noise of each of `--scales`)
reloaded through the engine. Without --url it starts a `vllm serve` of the tiny model with tied
embeddings (ops/lib/servers.py, float32) and stops it after; with --url, --model is the directory
the server serves.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


Row = tuple[str, int, int, int, int, float, float]  # weights, requests, n, max new tokens, tokens, max, mean


def measure(url: str, model: Path, scratch: Path, *, requests: list[int], n: list[int], tokens: list[int],
            repeats: int, temperature: float, scales: list[float]) -> list[Row]:
    """Each shape on the served weights, then on each perturbed copy reloaded into the server, as
    the tests reload one; the served weights are reloaded after."""
    import torch

    from engines.base import SamplingSettings
    from engines.openai_engine import OpenAIEngine
    from ops.lib.groups import ask
    from ops.lib.models import perturbed_copy, reference_logprobs

    engine = OpenAIEngine(url, model)
    rows = []
    shapes = [(r, k, t) for r in requests for k in n for t in tokens]
    checkpoints = [("served", model)] + [(f"reloaded, noise {scale:g}", perturbed_copy(
        model, scratch / f"noise_{scale:g}", seed=1, scale=scale)) for scale in scales]
    for weights, model_dir in checkpoints:
        engine.load_weights(model_dir, version=1)
        trainer = reference_logprobs(model_dir)
        for shape, (n_requests, group, max_new) in enumerate(shapes):
            prompts = [engine.prompt_ids(ask(1000 * shape + i)) for i in range(n_requests)]
            settings = SamplingSettings(n=group, max_new_tokens=max_new, temperature=temperature)
            diffs = []
            for _ in range(repeats):
                for prompt, samples in zip(prompts, engine.sample(prompts, settings), strict=True):
                    diffs += [(torch.tensor(s.logprobs) - trainer(prompt, s.ids, temperature)).abs() for s in samples]
            d = torch.cat(diffs)  # (tokens,)
            rows.append((weights, n_requests, group, max_new, d.numel(), d.max().item(), d.mean().item()))
            print(f"  {weights}: {n_requests} x n={group} x {max_new}: {d.numel()} tokens, max {d.max().item():.2e}",
                  file=sys.stderr)
    engine.load_weights(model, version=2)
    engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one of the tied tiny model)")
    parser.add_argument("--model", type=Path, help="with --url: the model directory the server serves")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16], help="concurrent requests per shape")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4], help="completions per request")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 128], help="max new tokens per shape")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per shape")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--scales", type=float, nargs="+", default=[0.05, 0.5], help="noise of the reloaded copies")
    args = parser.parse_args()
    assert bool(args.url) == bool(args.model), "--url and --model go together"
    sys.path.insert(0, str(ROOT))
    settings = dict(requests=args.requests, n=args.n, tokens=args.tokens, repeats=args.repeats,
                    temperature=args.temperature, scales=args.scales)
    with tempfile.TemporaryDirectory() as tmp:
        if args.url:
            rows = measure(args.url, args.model, Path(tmp), **settings)
        else:
            from common.tiny import build_tiny_model
            from ops.lib.models import tied_variant
            from ops.lib.servers import vllm_server

            model = tied_variant(build_tiny_model(Path(tmp) / "tiny"), Path(tmp) / "tied")
            with vllm_server(model, Path(tmp) / "server") as url:
                rows = measure(url, model, Path(tmp), **settings)
    print(f"| weights | requests at once | n | max new tokens | tokens | max abs diff | mean abs diff |  "
          f"(T={args.temperature}, {args.repeats} rounds)")
    print("|---|---|---|---|---|---|---|")
    for weights, n_requests, group, max_new, count, worst, mean in rows:
        print(f"| {weights} | {n_requests} | {group} | {max_new} | {count} | {worst:.2e} | {mean:.1e} |")
    for weights in dict.fromkeys(r[0] for r in rows):
        print(f"max over all shapes, {weights}: {max(r[5] for r in rows if r[0] == weights):.2e}")


if __name__ == "__main__":
    main()
