"""Reward functions run in worker processes, with a time budget per completion.

A reward function is user code: it may raise, loop forever or sleep. The generator must neither
die nor stall on it, so rewards run in a few worker processes, started with "spawn" (the
generator holds torch and its threads, which a fork would copy half-alive). A worker that
overruns its budget is killed with SIGKILL, together with its process group (whatever the reward
started goes too), and replaced; the completion gets reward 0.0 with the error
"timeout after X s", and the rest of its group is scored by the replacement.

Protocol, one duplex pipe per worker: the worker says ("ready", None) once it has loaded its
reward functions (or ("failed", why)); then the parent sends one prompt's group as
(source, prompt, messages, meta, [(text, ids), ...], version, given) and the worker answers one (reward,
components, error) per completion, in order, as each is scored. Each completion has its own budget
of `timeout_s`, counted from when the worker could start on it: the request sent, or the previous
result received. A source with a TRL reward function (called once for the whole group, before the
first result) gives the first result the group's budget, `timeout_s` x (completions + 1); when that
runs out, every completion left gets the timeout error. A worker's start-up (imports) is not counted.
`given` holds the group's reward-model values (below), {name: value per completion, or the error}.

The functions are loaded in the workers from their "module:function" names and weights, which come
from the config at start-up; a request only says which source's reward to use. Whether TRL functions
get a source's prompt and completions as messages or as text is the source's format
(`conversational_sources`, common/rewards.py says why): the runner sends a prompt's messages only
for a conversational source, and the weight version the group was sampled with.

Reward models ("model:PATH" entries, common/reward_models.py) run in the generator itself, not in
the workers: one copy per generator on its device, loaded on the first group that needs it, one
thread running them, each group in one batch before its functions are sent to a worker (their
values travel with the request, so the worker sums them with the functions'). A model's call has
the group's budget, `timeout_s` x (completions + 1), its loading not counted; past it, or when it
raises or cannot be loaded, every completion of the group gets the error, as a TRL function's
failure gives. A call that overran cannot be killed (it is the generator's own thread): the next
group's model call waits for it.
LLM judges ("judge:PATH?parser=..." entries, common/judges.py) run the same way, one batched
`generate` per group; an answer that does not parse is that completion's error alone (a string
among the judge's values). A judge at a URL ("judge:http://...", common/served_judges.py) runs in
that thread too, its group's requests sent at once from threads of its own; a request that fails
for good is that completion's error alone.

Workers are daemonic (they end with the generator; a reward cannot itself start multiprocessing
children, subprocesses are fine), run in their own process group (a Ctrl-C at the terminal reaches
the generator only), and exit when their pipe closes or, while a reward hangs, within a second of the generator's death.
Spawn runs the main script again in each worker (as "__mp_main__"), so a script that makes a
RewardRunner keeps its work under `if __name__ == "__main__":`; `python -m generators` is exempt
(a package's __main__ is never re-run).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from common import judges, reward_models, rewards, served_judges
from generators import processes

if TYPE_CHECKING:
    from common.config import Config


@dataclass(frozen=True, slots=True)
class Scored:
    reward: float              # sum of the components; 0.0 on error
    rewards: dict[str, float]  # named components; {} on error
    error: str | None          # why the reward failed (raised, timed out, bad return), else None


# the rewards the generator runs itself, in its model thread, not in its reward workers
_RUN_HERE = reward_models.RewardModel | judges.Judge | served_judges.ServedJudge

Names = dict[str, str | list[tuple[str, float]]]  # {source: "module:function" or [(name, weight), ...]}


def _funcs(spec: str | list[tuple[str, float]]) -> list[tuple[str, float]]:
    return [(spec, 1.0)] if isinstance(spec, str) else [(n, float(w)) for n, w in spec]


def reward_names(config: Config) -> Names:
    """{source name: [("module:function", weight), ...]} of the run's sources. Each is loaded here
    once, so that a bad name stops the generator at start-up with the field that names it."""
    from common.config import ConfigError  # here: the workers import this module, not pydantic

    names: Names = {}
    for i, source in enumerate(config.sources):
        field = "reward_funcs" if source.reward_funcs else "reward"
        try:
            rewards.load_all(source.reward_functions)
        except ValueError as err:
            raise ConfigError(f"data.sources.{i}.{field}: {err}") from None
        names[source.name] = source.reward_functions
    return names


def conversational_sources(config: Config) -> frozenset[str]:
    """The run's sources whose prompts TRL reward functions get as messages (the rest: as text)."""
    return frozenset(s.name for s in config.sources if rewards.conversational(s))


def trl_formats(config: Config) -> list[str]:
    """One line per source with TRL reward functions: what they get, messages or text, and why."""
    lines = []
    for source in config.sources:
        models = [n for n, _ in source.reward_functions if reward_models.is_model(n)]
        judged = [n for n, _ in source.reward_functions if judges.is_judge(n)]
        trl = [n for n, _ in source.reward_functions
               if n not in models + judged and rewards.is_batched(rewards.load(n))]
        if trl:
            how = ("as messages (its rows hold messages)" if rewards.conversational(source) else
                   "as text (its prompt is text; a messages_column source gives messages)")
            lines.append(f"source {source.name}: TRL reward functions {', '.join(trl)} get prompts and "
                         f"completions {how}")
        if models:
            how = ("the conversation under each model's chat template" if rewards.conversational(source) else
                   "prompt + completion as text")
            lines.append(f"source {source.name}: reward models {', '.join(models)} score {how}")
        if judged:
            lines.append(f"source {source.name}: LLM judges {', '.join(judged)} read each completion's text in their "
                         f"template (for messages: with the last user message as the prompt)")
    return lines


# ---------------------------------------------------------------------- the worker process


def _load(names: Names, dtype: str = "float32") -> dict[str, list[rewards.RewardFunc]]:
    return {source: rewards.load_all(_funcs(spec), dtype=dtype) for source, spec in names.items()}


def _serve(fns: dict[str, list[rewards.RewardFunc]], conn: Connection) -> None:
    """Score groups until the pipe closes."""
    while True:
        try:
            source, prompt, messages, meta, completions, version, given = conn.recv()
        except EOFError:  # the generator closed the pipe, or is gone
            return
        for result in rewards.score_group(fns[source], prompt=prompt, messages=messages, completions=completions,
                                          meta=meta, state=rewards.TrainerState(global_step=version), given=given):
            conn.send(result)


def _worker(names: Names, conn: Connection, parent: int) -> None:
    processes.serve_worker(partial(_load, names), _serve, conn, parent)


# ---------------------------------------------------------------------- the runner


@dataclass(slots=True, eq=False)
class _Slot:
    worker: processes.Worker  # the slot's current worker; replaced when it is killed or dies


class RewardRunner:
    """Scores completions with their source's reward in `workers` processes, each completion
    within `timeout_s`; a reward that raises, hangs or returns garbage is that completion's
    recorded error. Concurrent `score` calls take different workers (waiting while all are busy).
    """

    def __init__(self, names: Names, *, timeout_s: float, workers: int,
                 conversational: frozenset[str] = frozenset(), dtype: str = "float32") -> None:
        """names: {source name: "module:function" or [("module:function", weight), ...]}.
        conversational: the sources whose TRL functions get messages (`conversational_sources`).
        workers=0: run in this process, no timeout (for tests and debugging). A name that does not
        load raises ValueError; a worker that cannot load them raises RuntimeError. dtype: the
        reward models' ("model:PATH" entries, run in this process), the generator's model dtype."""
        assert timeout_s > 0, f"timeout_s must be positive, got {timeout_s}"
        assert workers >= 0, f"workers must be >= 0, got {workers}"
        self._names = dict(names)
        self._conversational = frozenset(conversational)
        self._fns = _load(self._names, dtype)  # loaded here too, to fail fast; its reward models run here
        self._timeout_s = timeout_s
        self._in_process = workers == 0
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model") if any(
            self._models(key) for key in self._fns) else None
        self._closed = False
        self._pool = processes.WorkerPool(_worker, (self._names,), workers=workers, kind="reward",
                                          loads="its rewards")

    @property
    def restarts(self) -> int:
        """Workers killed (timeout) or found dead, and replaced."""
        return self._pool.restarts

    def pids(self) -> list[int]:
        """The process ids of its workers."""
        return self._pool.pids()

    def score(self, source: str | None, *, prompt: str, completions: list[tuple[str, list[int]]],
              meta: dict[str, Any], messages: list[dict[str, str]] | None = None, version: int = 0) -> list[Scored]:
        """Score each (text, ids) completion of one prompt with the source's rewards (None: the only
        configured source; an unknown source: every completion gets an error). `messages`: the chat
        prompt, given to TRL functions when the source is conversational (else they get `prompt`).
        `version`: the weight version the completions were sampled with (TRL's
        `trainer_state.global_step`). Blocking; thread-safe."""
        assert not self._closed, "score() on a closed RewardRunner"
        if isinstance(source, str) and source in self._names:
            key = source
        elif source is None and len(self._names) == 1:
            key = next(iter(self._names))
        else:
            return [Scored(0.0, {}, f"no reward configured for source {source!r} (have {sorted(self._names)})")
                    for _ in completions]
        if not completions:
            return []
        if key not in self._conversational:
            messages = None
        state = rewards.TrainerState(global_step=version)
        given = self._model_values(key, prompt=prompt, messages=messages, completions=completions, meta=meta,
                                   state=state)
        if self._in_process or len(given) == len(self._fns[key]):  # nothing left for a worker: models only
            return [Scored(*r) for r in rewards.score_group(self._fns[key], prompt=prompt, messages=messages,
                                                            completions=completions, meta=meta, state=state,
                                                            given=given)]
        slot = _Slot(self._pool.take())  # blocks while every worker is busy
        try:
            return self._run(slot, key, prompt=prompt, messages=messages, completions=completions, meta=meta,
                             version=version, given=given)
        finally:
            self._pool.give(slot.worker)

    def close(self) -> None:
        """Kill every worker. Call it once no `score` is running; `score` afterwards is an error."""
        self._closed = True
        self._pool.close()
        if self._model_thread is not None:
            self._model_thread.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _models(self, source: str) -> list[rewards.RewardFunc]:
        return [f for f in self._fns[source] if isinstance(f.fn, _RUN_HERE)]

    def _model_values(self, source: str, *, prompt: str, messages: list[dict[str, str]] | None,
                      completions: list[tuple[str, list[int]]], meta: dict[str, Any],
                      state: rewards.TrainerState) -> dict[str, list[float | None | str] | str]:
        """{name: value per completion, or the error} of the source's reward models, each run on the
        whole group in this process's model thread within the group's budget (no budget in-process)."""
        out: dict[str, list[float | None | str] | str] = {}
        for f in self._models(source):
            assert isinstance(f.fn, _RUN_HERE)
            try:
                f.fn.load()  # the first group's wait for the weights is not counted in its budget
            except RuntimeError as err:
                out[f.name] = str(err)
                continue
            call = partial(rewards.call_group, [f], prompt=prompt, messages=messages, completions=completions,
                           meta=meta, state=state)
            if self._in_process:
                out.update(call())
                continue
            assert self._model_thread is not None
            budget = self._timeout_s * (len(completions) + 1)
            future = self._model_thread.submit(call)
            try:
                out.update(future.result(timeout=budget))
            except FutureTimeout:
                future.cancel()  # still queued behind an overrunning call: never run it
                out[f.name] = f"{f.name}: timeout after {budget:g} s"
        return out

    def _run(self, slot: _Slot, source: str, *, prompt: str, messages: list[dict[str, str]] | None,
             completions: list[tuple[str, list[int]]], meta: dict[str, Any], version: int,
             given: dict[str, list[float | None | str] | str]) -> list[Scored]:
        """The group's results from the slot's worker, replacing it when it times out or dies and
        going on with the rest of the group on the replacement. `given`: the reward models' values."""
        results: list[Scored] = []
        batched = any(f.batched and f.name not in given for f in self._fns[source])
        while len(results) < len(completions):
            worker = slot.worker
            failed = self._pool.await_ready(worker)
            if failed is not None:  # a replacement that cannot start: nothing to run the rest on
                slot.worker = self._pool.replace(worker)
                return results + [Scored(0.0, {}, failed) for _ in completions[len(results):]]
            try:
                rest = {name: v if isinstance(v, str) else v[len(results):] for name, v in given.items()}
                worker.conn.send((source, prompt, messages, meta, completions[len(results):], version, rest))
            except OSError:  # it died while idle (killed from outside): a fresh one takes the group
                slot.worker = self._pool.replace(worker)
                continue
            first = batched  # the first result waits for the group's TRL calls too
            while len(results) < len(completions):
                budget = self._timeout_s * (len(completions) - len(results) + 1) if first else self._timeout_s
                if not worker.conn.poll(budget):
                    late = len(completions) - len(results) if first else 1
                    results += [Scored(0.0, {}, f"timeout after {budget:g} s")] * late
                    slot.worker = self._pool.replace(worker)
                    break
                first = False
                try:
                    results.append(Scored(*worker.conn.recv()))
                except (EOFError, OSError):  # the reward took the worker down (os._exit, a crash)
                    worker.process.join(timeout=1.0)
                    results.append(Scored(0.0, {}, f"reward worker died (exit code {worker.process.exitcode})"))
                    slot.worker = self._pool.replace(worker)
                    break
        return results
