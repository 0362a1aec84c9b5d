"""Inference engines: sample completions with their behaviour log-probs, reload weights in place.

`base` holds the interface and its types, `hf_engine` and `vllm_engine` the two engines, and
`choice` picks and opens one. Used by the generators and the evaluator; imports no process package.
"""
