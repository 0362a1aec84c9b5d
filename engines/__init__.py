"""Inference engines: sample completions with their behaviour log-probs, reload weights in place.

`base` holds the interface and its types, `hf_engine` and `vllm_engine` the in-process engines,
`openai_engine` the server engine, `vllm_worker` what runs inside vLLM's workers (the tied
lm_head's refresh after a reload), and `choice` picks and opens one. Used by the generators and
the evaluator; imports no process package.
"""
