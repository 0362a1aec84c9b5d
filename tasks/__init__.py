"""The built-in tasks: each module holds a task's problems and its reward, side by side.

- `arithmetic`: "What is 8 + 9?" problems drawn from a seed, and their reward.
- `countdown`: reach a target from given numbers, and its reward.
- `gsm8k`: reading a final answer (GSM8K's "####", \\boxed{}, the last number) and its reward,
  for data sets of such problems.
- `format`: whether a completion ends in a marked final answer (a reward to add to another).
- `reverse`: reverse a word of random letters, and its reward.
- `shapes`: count the shapes in a generated picture (a vision-language task), and its reward.

A synthetic task is one module here, found by its `Options` model (pydantic): its fields are the
options of a `[[data.sources]]` table whose `kind` is the module's name (common.config makes that
source variant), `make_prompt(options, *, seed, index) -> (user message, meta)` draws the
`index`-th problem, and `reward` scores it as the source's built-in reward (tasks/reverse.py is the
smallest). A visual task's `make_prompt` returns its images (PNG bytes) as a third item.

The producer draws problems from them, the generators score with their rewards (named in the
config as "tasks.arithmetic:reward"), and the evaluator does both. A reward function takes the
keyword arguments `prompt`, `completion`, `completion_ids` and `meta` and returns a number or
named components `{component: value}` (the reward is their sum). To combine rewards, write a
function that calls others and merges their components:

    from tasks import format, gsm8k

    def answer_and_format(**kw):  # reward = "my_rewards:answer_and_format"
        return {**gsm8k.reward(**kw), "format": 0.1 * format.reward(**kw)["format"]}

A source may instead list several functions with weights (`reward_funcs`, `reward_weights`), and
functions written for TRL's GRPOTrainer work unchanged (common/rewards.py says how each is called).
`rows` turns data set rows into prompts, for the producer and the evaluator alike.

This package imports no process package (nor torch): the generators' reward workers load it.
"""
