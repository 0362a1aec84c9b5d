"""verifiers tasksets the tests train on: weighted reward hooks that read the trace, and tasksets
rollouts must refuse (a reward that needs verifiers' runtime, none at all)."""

from __future__ import annotations

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    word: str  # what the reply should contain


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=0.5)
    async def says_something(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply else 0.0

    @vf.reward(weight=2.0)
    async def length(self, trace: vf.Trace) -> float:
        return min(len(trace.last_reply), 10) / 10

    @vf.reward(weight=1.0)
    async def has_word(self, trace: vf.Trace) -> float:
        return 1.0 if self.data.word in trace.last_reply else 0.0


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 6


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        words = ["apple", "river", "stone", "cloud", "ember", "maple", "quartz", "violet"]
        return [EchoTask(EchoData(prompt=f"Say the word {w}.", system_prompt="You repeat words.", word=w),
                         self.config.task) for w in words[:self.config.num_tasks]]


class BoxTask(vf.Task[EchoData]):
    @vf.reward(weight=1.0)
    async def file_written(self, trace: vf.Trace, runtime: vf.Runtime) -> float:  # reads the harness's box
        return float((await runtime.run("test -f out.txt")).exit_code == 0)


class BoxTaskset(vf.Taskset[BoxTask, EchoConfig]):
    def load(self) -> list[BoxTask]:
        return [BoxTask(EchoData(prompt="Write out.txt.", word="x"), self.config.task)]


class SilentTask(vf.Task[EchoData]):
    pass


class SilentTaskset(vf.Taskset[SilentTask, EchoConfig]):
    def load(self) -> list[SilentTask]:
        return [SilentTask(EchoData(prompt="Anything.", word="x"), self.config.task)]
