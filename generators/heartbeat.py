"""Beside the pipeline: the heartbeat (the hash `rollouts status` reads, leases renewed, held prompts
touched) and the signals (the first stops the intake, the second everything)."""

from __future__ import annotations

import math
import signal
import sys
import time

import trio

from common.heartbeats import Heartbeat, write_heartbeat
from common.process import ENV_STOP_GRACE, STOP_MARGIN_S, exit_within, stop_grace_s
from common.quarantine import Quarantine, read_quarantine
from engines.base import Engine
from engines.choice import engine_kind
from generators import devices
from generators.prompts import touch_held
from generators.state import Generator, State


async def heartbeats(g: Generator, state: State) -> None:
    """Write the heartbeat hash and renew the GPU lease every few seconds (at once on news), and
    keep the held prompts from looking idle to the other generators."""
    touched = time.monotonic()
    while True:
        if time.monotonic() - touched > g.settings.claim_idle_s / 3:
            touched = time.monotonic()
            await trio.to_thread.run_sync(lambda held=list(state.held): touch_held(
                g.r, stream=g.keys.prompts, consumer=g.id, held=held))
        await trio.to_thread.run_sync(lambda: note_quarantine(g, state, read_quarantine(g.r, g.keys, g.id)))
        beat = heartbeat(state, g.engine)
        await trio.to_thread.run_sync(lambda b=beat: write_heartbeat(
            g.r, g.keys, g.id, b, ttl_s=g.settings.heartbeat_ttl_s))
        if engine_kind(g.settings.engine).server:
            await trio.to_thread.run_sync(lambda: devices.renew_server(
                g.r, g.keys, url=g.settings.server_url, owner=g.id, ttl_s=g.settings.heartbeat_ttl_s))
        if g.gpu is not None:
            await trio.to_thread.run_sync(lambda: devices.renew_gpu(
                g.r, g.keys, host=g.host, device=g.gpu, owner=g.id, ttl_s=g.settings.heartbeat_ttl_s))
        with trio.move_on_after(min(5.0, g.settings.heartbeat_ttl_s / 3, g.settings.claim_idle_s / 3)):
            await state.news.wait()
        state.news = trio.Event()


def note_quarantine(g: Generator, state: State, q: Quarantine | None) -> None:
    """Keep the trainer's quarantine of this generator, saying so when it changes."""
    if q == state.quarantine:
        return
    if q is not None:
        then = ("it stops sampling (fix its config or host and start it again)" if q.final else
                "it takes no prompt until it has loaded weights the trainer publishes next")
        print(f"{g.name}: {q.line()}; {then}", file=sys.stderr, flush=True)
    else:
        print(f"{g.name}: readmitted by the trainer", flush=True)
    state.quarantine = q


def heartbeat(state: State, engine: Engine) -> Heartbeat:
    """What the heartbeat says of this generator now (`rollouts status` shows it)."""
    return Heartbeat(engine=engine.name, version=engine.version, tokens_per_s=state.tokens_per_s(),
                     in_flight=len(state.held), groups=state.groups, reward_errors=state.reward_errors,
                     dropped_zero_variance=state.dropped_zero_variance, weights_refused=state.weights_refused,
                     last_refusal=state.last_refusal, env_errors=state.env_errors, engine_errors=state.engine_errors,
                     teacher_errors=state.teacher_errors)


async def signals(runs: list[tuple[Generator, State]], everything: trio.CancelScope) -> None:
    """The first SIGTERM/SIGINT stops the intake of every run served (what is held is finished);
    the second cancels `everything` and sets the exit code. Under a launcher that kills what still
    runs STOP_GRACE_S after its signal, what is not finished STOP_MARGIN_S before then is given up:
    `everything` is cancelled and the generator exits 0 in time, its unfinished prompts pending,
    unwritten, for a generator to take over after claim_idle_s (nothing is lost: a prompt is
    acknowledged only in the transaction that writes its group). One handler for all the runs: a
    process's signal reaches only the receiver opened last."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for _ in received:
            grace = stop_grace_s()
            for g, state in runs:
                state.stopping = True
                g.intake_scope.cancel()
                print(f"{g.name}: finishing the {len(state.held)} prompts it holds (signal again to exit now)",
                      file=sys.stderr, flush=True)
            with trio.move_on_after(math.inf if grace is None else max(grace - STOP_MARGIN_S, 0.0)):
                async for signum in received:
                    print(f"{runs[0][0].name}: second signal, exiting now", file=sys.stderr, flush=True)
                    for _, state in runs:
                        state.exit_code = 128 + signum
                    everything.cancel()
                    return
            for g, state in runs:
                print(f"{g.name}: giving up the {len(state.held)} prompts it has not finished: the "
                      f"launcher kills what still runs {grace:g} s after its signal ({ENV_STOP_GRACE}). They stay "
                      f"pending, unwritten, and are taken over after claim_idle_s ({g.settings.claim_idle_s:g} s)",
                      file=sys.stderr, flush=True)
            exit_within(STOP_MARGIN_S / 4)  # clean up meanwhile if it can (leases and heartbeats expire anyway)
            everything.cancel()
            return

