"""Environment steps run in worker processes, each call within a time limit, as rewards do.

An environment's `start` and `step` are user code (envs/base.py): they may raise, hang, or run
tools that do. So they run in a few worker processes started with "spawn", never in the engine's
thread or the generator's event loop. The episode's state travels with each call (the worker keeps
none), so a worker killed for overrunning its limit loses nothing: the call answers with an error,
the state stays what it was, and a fresh worker takes the slot. Workers run in their own process
group (a kill takes what the tool started along) and exit when the generator is gone.

Protocol, one duplex pipe per worker: the worker says ("ready", None) once it has loaded the
environments (or ("failed", why)); then each request is (op, name, args) with op "start"
(args: meta) or "step" (args: state, text), answered by ("ok", result) or ("error", why). A
call's limit counts from when a worker takes it (waiting for a free worker is not counted).
"""

from __future__ import annotations

from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from envs import base
from generators import processes

if TYPE_CHECKING:
    from common.config import Config


def environment_specs(config: Config) -> dict[str, base.Spec]:
    """{source name: its environment's Spec} of the run's sources that name one. Each is loaded
    here, so a bad name stops the generator at start-up with the field that names it."""
    from common.config import ConfigError  # here: the workers import this module, not pydantic

    specs = {}
    for i, source in enumerate(config.sources):
        if not source.environment:
            continue
        try:
            specs[source.name] = base.spec(source.environment)
        except ValueError as err:
            raise ConfigError(f"data.sources.{i}.environment: {err}") from None
    return specs


# ---------------------------------------------------------------------- the worker process


def _call(envs: dict[str, Any], op: str, name: str, args: tuple) -> tuple[str, Any]:
    env = envs[name]
    try:
        if op == "start":
            return "ok", env.start(*args)
        return "ok", base.check_step(env.step(*args))
    except Exception as err:  # user code: any failure is answered as the step's error
        return "error", f"{type(err).__name__}: {err}"[:500]


def _load(names: list[str]) -> dict[str, Any]:
    return {name: base.load(name) for name in names}


def _serve(envs: dict[str, Any], conn: Connection) -> None:
    """Answer start and step requests until the pipe closes."""
    while True:
        try:
            op, name, args = conn.recv()
        except EOFError:
            return
        answer = _call(envs, op, name, args)
        try:
            conn.send(answer)
        except (TypeError, AttributeError, ValueError) as err:  # pickling: a state that does not pickle
            conn.send(("error", f"the environment's {op} returned what cannot be sent back: {err}"))


def _worker(names: list[str], conn: Connection, parent: int) -> None:
    processes.serve_worker(partial(_load, names), _serve, conn, parent)


# ---------------------------------------------------------------------- the runner


class EnvRunner:
    """Runs environments' `start` and `step` in `workers` processes, each call within its own
    time limit; concurrent calls take different workers (waiting while all are busy)."""

    def __init__(self, names: list[str], *, workers: int) -> None:
        assert workers >= 1, f"workers must be >= 1, got {workers}"
        self._names = sorted(set(names))
        self._closed = False
        self._pool = processes.WorkerPool(_worker, (self._names,), workers=workers, kind="environment",
                                          loads="its environments")

    @property
    def restarts(self) -> int:
        """Workers killed (time limit) or found dead, and replaced."""
        return self._pool.restarts

    def pids(self) -> list[int]:
        """The process ids of its workers."""
        return self._pool.pids()

    def start(self, name: str, meta: dict[str, Any], *, timeout_s: float) -> tuple[Any, str | None]:
        """(the episode's state, None), or (None, why it failed)."""
        return self._request("start", name, (meta,), timeout_s)

    def step(self, name: str, state: Any, text: str, *, timeout_s: float) -> tuple[base.Step | None, str | None]:
        """(the environment's Step, None), or (None, why it failed: raised, timed out, died)."""
        return self._request("step", name, (state, text), timeout_s)

    def close(self) -> None:
        self._closed = True
        self._pool.close()

    def __enter__(self) -> EnvRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _request(self, op: str, name: str, args: tuple, timeout_s: float) -> tuple[Any, str | None]:
        assert not self._closed, f"{op}() on a closed EnvRunner"
        assert name in self._names, f"environment {name!r} was not loaded (have {self._names})"
        worker = self._pool.take()  # blocks while every worker is busy
        try:
            failed = self._pool.await_ready(worker)
            if failed is not None:
                worker = self._pool.replace(worker)
                return None, failed
            try:
                worker.conn.send((op, name, args))
            except OSError:  # it died while idle
                worker = self._pool.replace(worker)
                return None, "environment worker died"
            if not worker.conn.poll(timeout_s):
                worker = self._pool.replace(worker)
                return None, f"the environment did not answer within {timeout_s:g} s"
            try:
                kind, value = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join(timeout=1.0)
                code = worker.process.exitcode
                worker = self._pool.replace(worker)
                return None, f"environment worker died (exit code {code})"
            return (value, None) if kind == "ok" else (None, value)
        finally:
            self._pool.give(worker)
