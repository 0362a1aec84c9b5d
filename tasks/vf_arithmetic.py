"""The built-in arithmetic task written as a `verifiers` taskset: the example of a taskset a
`kind = "verifiers"` source trains on (`taskset = "tasks.vf_arithmetic"`), and what its tests use.

A taskset of your own has the same shape: a `vf.TaskData` with the row's ground truth, a `vf.Task`
whose `@vf.reward` hooks read the trace, and a `vf.Taskset` whose `load` makes the tasks.
"""

from __future__ import annotations

import verifiers.v1 as vf

from tasks import arithmetic


class ArithmeticData(vf.TaskData):
    answer: int  # the ground truth


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the reply's final integer is the answer (the built-in arithmetic reward's rule)."""
        return arithmetic.reward(prompt="", completion=trace.last_reply, completion_ids=[],
                                 meta={"answer": self.data.answer})["correct"]


class ArithmeticConfig(vf.TasksetConfig):
    num_tasks: int = 100
    """How many problems."""
    seed: int = 0
    """Which problems (the arithmetic task's seed)."""
    max_operand: int = 20
    """Operands are drawn from [0, max_operand]."""


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self) -> list[ArithmeticTask]:
        c = self.config
        problems = (arithmetic.problem(seed=c.seed, index=i, max_operand=c.max_operand, ops=["+", "-"])
                    for i in range(c.num_tasks))
        return [ArithmeticTask(ArithmeticData(prompt=p.question, answer=p.answer), c.task) for p in problems]


__all__ = ["ArithmeticTaskset"]
