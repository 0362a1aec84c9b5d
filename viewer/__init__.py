"""`rollouts view`: a local web page over a run's sample groups, token by token.

It reads what the run's processes wrote (the samples stream in Redis, or a recording made by
`rollouts record`, and the trainer's metrics.jsonl) through `common/`'s types only, as any reader
of the run may; no process imports it, and it imports no process. `common.cli` starts it as its
own process (`python -m viewer`), as it starts `rollouts check`.
"""
