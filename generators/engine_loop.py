"""The engine stage: add arrived prompts and episode turns to the engine and step it (continuous
batching), and load newer weights at a safe point (nothing in flight, or mid-sequence with
in-flight updates), their files checked first; the watcher hands each announced version to it."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import shutil
import sys
import time
from collections import deque
from functools import partial
from pathlib import Path

import trio

from common.checkpoints import CheckpointError
from common.messages import WeightVersion
from engines.base import Engine, SamplingSettings
from generators.state import Generator, Held, State, let_go, run_on_engine
from generators.transfer import Receiver
from generators.weights import Checked, check, unpin


async def engine_loop(g: Generator, state: State) -> None:
    """Add arrived prompts to the engine and step it; load newer weights when nothing is in flight.
    Ends when the intake has ended and every prompt it took has been sampled."""
    waiting: deque[Held] = deque()  # arrived, not yet added to the engine
    running = 0  # added to the engine, not finished; at most engine.max_running, so that
    # the rest wait here, where newer weights can still reach them before they start
    asked = -1  # the newest admitted_at weights:latest was read for
    intake_done = False
    while True:
        state.wake = trio.Event()  # what is queued from here on wakes the idle wait below
        if take_arrived(g.arrived, waiting):
            intake_done = True
        # A prompt admitted at a newer version than ours: read the latest weights now, once
        # per version asked for (later ones come with the watcher's polls).
        wanted = max((h.task.admitted_at for h in waiting), default=-1)
        if wanted > max(g.engine.version, asked):
            asked = wanted
            state.latest = await trio.to_thread.run_sync(g.r.get, g.keys.weights_latest)
        newer = state.latest is not None and state.latest != state.acted_on or state.went_back is not None
        if newer and (g.settings.inflight_updates or not g.engine.has_unfinished()) and not state.episodes:
            await load_weights(state, g.engine, g.engine_thread, name=g.name, weights_url=g.settings.weights_url,
                               fetch_dir=g.fetch_dir, pin_root=pin_root(g), receiver=g.received)
            newer = state.went_back is not None  # an older version waits for the engine to drain
        if state.turns and running < g.engine.max_running:  # episodes in flight go on, newer weights or not
            running += await add_turns(g, state, room=g.engine.max_running - running)
        if waiting and not newer and running < g.engine.max_running:
            # join the running batch; with newer weights pending, drain first
            running += await add_waiting(g, state, waiting, room=g.engine.max_running - running)
        if g.engine.has_unfinished():
            running -= await step_engine(g, state)
            continue
        if intake_done and not waiting and not state.episodes:
            break
        # idle: wait for a prompt to arrive, an episode's turn, or newer weights to show up
        intake_done = await wait_for_work(g, state, waiting, intake_done=intake_done)
    await g.finished_send.aclose()
    await g.episodes_send.aclose()


async def wait_for_work(g: Generator, state: State, waiting: deque[Held], *, intake_done: bool) -> bool:
    """Wait up to `weights_poll_s` for a prompt to arrive (into `waiting`) or an episode to queue a
    turn or end (`state.wake`); whether the intake has ended."""
    async with trio.open_nursery() as race:
        race.cancel_scope.deadline = trio.current_time() + g.settings.weights_poll_s

        async def prompt() -> None:
            nonlocal intake_done
            try:
                waiting.append(await g.arrived.receive())
            except trio.EndOfChannel:
                intake_done = True
            race.cancel_scope.cancel()

        async def woken() -> None:
            await state.wake.wait()
            race.cancel_scope.cancel()

        if not intake_done:
            race.start_soon(prompt)
        race.start_soon(woken)
    return intake_done


def take_arrived(arrived: trio.MemoryReceiveChannel[Held], waiting: deque[Held]) -> bool:
    """Move every prompt that has arrived to `waiting`, without waiting; whether the intake has ended."""
    while True:
        try:
            waiting.append(arrived.receive_nowait())
        except trio.WouldBlock:
            return False
        except trio.EndOfChannel:
            return True


async def add_waiting(g: Generator, state: State, waiting: deque[Held], *, room: int) -> int:
    """Add up to `room` waiting prompts to the engine, stamped with its weight version; how many.
    A prompt of a source with an environment goes to the episodes stage instead (its turns come
    back as requests)."""
    version, now = g.engine.version, time.perf_counter()
    batch = [waiting.popleft() for _ in range(min(len(waiting), room))]
    for h in batch:
        h.version, h.added_at = version, now
    played = [h for h in batch if h.task.source in g.specs]
    for h in played:
        state.episodes += 1
        g.episodes_send.send_nowait(h)
    batch = [h for h in batch if h.task.source not in g.specs]
    requests = [(h.entry_id.decode(), h.prompt_ids, dataclasses.replace(g.sampling, n=h.task.n), h.task.images)
                for h in batch]
    if requests:
        await run_on_engine(g.engine_thread, add_all, g.engine, requests, timeout_s=g.settings.engine_timeout_s)
    return len(batch)


async def add_turns(g: Generator, state: State, *, room: int) -> int:
    """Add up to `room` queued episode turns to the engine; how many."""
    batch = [state.turns.popleft() for _ in range(min(len(state.turns), room))]
    for turn in batch:
        state.sampling[turn.request_id] = turn
    await run_on_engine(g.engine_thread, add_all, g.engine,
                        [(t.request_id, t.ids, t.sampling, t.images) for t in batch],
                        timeout_s=g.settings.engine_timeout_s)
    return len(batch)


def add_all(engine: Engine, requests: list[tuple[str, list[int], SamplingSettings]
                                           | tuple[str, list[int], SamplingSettings, tuple[bytes, ...]]]) -> None:
    """Add each (request id, prompt ids, sampling[, images]) to the engine; a vision-language
    prompt's images (common/images.py) go with it."""
    for request_id, ids, sampling, *images in requests:
        if images and images[0]:
            engine.add(request_id, ids, sampling, images=images[0])
        else:
            engine.add(request_id, ids, sampling)


async def step_engine(g: Generator, state: State) -> int:
    """One engine step; each prompt it finished goes on to scoring. How many finished."""
    pending = partial(weights_pending, state) if g.settings.inflight_updates else None
    finished = await run_on_engine(g.engine_thread, partial(g.engine.step, yield_when=pending),
                                   timeout_s=g.settings.engine_timeout_s)
    for done in finished:
        if done.error is not None:
            state.engine_errors += 1
            print(f"{g.name}: engine request {done.request_id} failed: {done.error}", file=sys.stderr, flush=True)
        turn = state.sampling.pop(done.request_id, None)
        if turn is not None:  # an episode's turn: back to its episode
            turn.result, turn.error = (done.samples[0], None) if done.error is None else (None, done.error)
            turn.done.set()
        elif done.error is not None:
            let_go(g, state, state.held[done.request_id])
        else:
            held = state.held[done.request_id]
            newest = max([held.version] + [v for s in done.samples for _, v in s.versions or ()])
            held.published_at = state.published.get(newest, 0.0)
            g.finished_send.send_nowait((done, held))
    return len(finished)


def weights_pending(state: State) -> bool:
    """Whether newer weights wait to be loaded (in-flight updates: the engine yields to them). Called
    on the engine's thread once per sampled token: a read of two fields."""
    return state.latest is not None and state.latest != state.acted_on and not state.episodes


def pin_root(g: Generator) -> Path:
    """Where this generator pins the checkpoint it is about to load (beside the fetched ones), as an
    absolute path: a server engine reads it from its own working directory."""
    return (g.fetch_dir / f"pinned-{g.id}").absolute()


async def load_weights(state: State, engine: Engine, engine_thread: concurrent.futures.Executor, *,
                       name: str, weights_url: str = "", fetch_dir: Path | None = None,
                       pin_root: Path | None = None, receiver: Receiver | None = None) -> None:
    """Load the WeightVersion in `state.latest` if it is newer than the engine's, once its files
    are verified (the check begun when it was announced, else one begun now); a refusal (the
    payload does not decode, the files fail their checksums or do not fit the model) is counted
    and reported, and the engine keeps its weights.

    A version no newer than the engine's but published after its weights (a trainer restarted
    from an older state announces its steps again, with other weights) is loaded too, once the
    engine has nothing in flight: until then it waits in `state.went_back`, so that no completion
    spans versions that descend. One published before them (weights:latest read while the
    watcher had already seen newer) is passed over."""
    blob = state.acted_on = state.latest
    assert blob is not None
    waiting, state.went_back = state.went_back, None
    t0, loading_at = time.perf_counter(), time.time()
    checked = state.checked
    if checked is None or checked.blob != blob:
        unpin(checked)
        checked = state.checked = Checked(blob)  # before the check begins: the watcher does not begin another
        await check(checked, weights_url=weights_url, fetch_dir=fetch_dir, pin_root=pin_root, receiver=receiver,
                    stage=getattr(engine, "stage", None))
    checked.claimed = True  # its pin is this loader's to remove, once loaded
    try:
        await load_checked(state, engine, engine_thread, checked, name=name, waiting=waiting, t0=t0,
                           loading_at=loading_at)
    finally:
        checked.claimed = False
        if checked.pinned is not None and state.went_back != blob:  # loaded, refused or passed over
            shutil.rmtree(checked.pinned, ignore_errors=True)
            checked.pinned = None
            if state.checked is checked:
                state.checked = None


async def load_checked(state: State, engine: Engine, engine_thread: concurrent.futures.Executor, checked: Checked,
                       *, name: str, waiting: bytes | None, t0: float, loading_at: float) -> None:
    """load_weights once `checked` is verified."""
    blob = checked.blob
    await checked.done.wait()
    t1 = time.perf_counter()
    wv = checked.wv
    try:
        if checked.error:
            raise CheckpointError(checked.error)
        assert wv is not None
        back = wv.version <= engine.version or abandoned(wv, engine.version, state.published_at)
        if back and wv.created_at <= state.published_at:
            return
        if back and engine.has_unfinished():
            if waiting is None:
                print(f"{name}: weights version {wv.version} {anew(wv.version, engine.version)}: loading it once the "
                      "completions in flight are done", flush=True)
            state.went_back = blob
            return
        before = engine.version
        received = checked.tensors is not None
        try:
            if checked.tensors is not None:  # received over the trainer's broadcast
                tensors, checked.tensors = checked.tensors, None
                await run_on_engine(engine_thread, lambda: engine.load_tensors(tensors, version=wv.version))
            else:
                await run_on_engine(engine_thread, lambda: engine.load_weights(checked.path, version=wv.version))
        except OSError as err:  # a file gone between the check and the load: nothing was copied yet
            raise CheckpointError(f"checkpoint {checked.path} could not be read ({err}): removed or replaced "
                                  "after it was checked") from None
    except CheckpointError as err:
        state.weights_refused += 1
        state.last_refusal = str(err)
        state.news.set()
        print(f"{name}: refused weights: {err}", file=sys.stderr, flush=True)
        return
    state.news.set()
    if back:  # nothing in flight: the versions loaded before say nothing of what comes
        state.published.clear()
    state.published_at = state.published[wv.version] = wv.created_at
    announced, drained = timeline(state, wv, loading_at=loading_at)
    if back:
        print(f"{name}: weights version {wv.version} {anew(wv.version, before)}", flush=True)
    # "verify": the files' checksums, or, received over the trainer's broadcast, waiting for the receive
    # "read ahead": the engine's copy of the files, read beside its sampling once they were verified
    ahead = (f" from the files read ahead ({checked.staged:.2f} s beside sampling)"
             if checked.staged is not None and getattr(engine, "loaded_staged", False) else "")
    print(f"{name}: loaded weights version {wv.version} (verify {checked.seconds:.2f} s, reload "
          f"{time.perf_counter() - t1:.2f} s; announced {announced:.2f} s after publishing, drained {drained:.2f} s, "
          f"waited {t1 - t0:.2f} s for the checksums){' received over the broadcast' if received else ''}{ahead}",
          flush=True)


def abandoned(wv: WeightVersion, loaded: int, published_at: float) -> bool:
    """Whether the weights loaded (version `loaded`, published at `published_at`) are ones the
    trainer abandoned when it went back to an older state, as `wv` says (common/progress.py:GoneBack):
    loading `wv` then goes back too, even where its number is higher."""
    return loaded > wv.gone_back_step and published_at < wv.gone_back_at


def anew(version: int, loaded: int) -> str:
    """Why a version is loaded as one that goes back: numbered no higher than the engine's `loaded`
    one, or replacing weights the trainer abandoned."""
    if version > loaded:
        return f"replaces version {loaded}, which the trainer abandoned when it went back to an older state"
    if version < loaded:
        return f"announced after version {loaded}: the trainer went back to an older state"
    return "published again (other files; a trainer restarted from an older state, or its checkpoint was lost)"


async def watch_weights(g: Generator, state: State) -> None:
    """Hand each version the watcher sees announced to the engine loop (waking it), and check
    its files at once, while the engine finishes what is in flight; it loads at a safe point."""
    seen = 0
    while True:
        got = await trio.to_thread.run_sync(g.weights.wait, seen, 1.0, abandon_on_cancel=True)
        if got is None:
            if g.weights.error is not None:
                raise RuntimeError(f"{g.name}: the weights watcher stopped") from g.weights.error
            continue
        seen = got.seq
        state.latest, state.seen = got.blob, (got.blob, got.seen_at)
        state.wake.set()  # an idle engine loop loads it now
        if state.checked is None or state.checked.blob != got.blob:
            unpin(state.checked)  # a newer version replaces it before it was loaded
            state.checked = Checked(got.blob)
            await check(state.checked, weights_url=g.settings.weights_url, fetch_dir=g.fetch_dir,
                        pin_root=pin_root(g), receiver=g.received, stage=getattr(g.engine, "stage", None))


def timeline(state: State, wv: WeightVersion, *, loading_at: float) -> tuple[float, float]:
    """Seconds from the trainer publishing `wv` (its created_at) until the watcher saw it, and
    from then until the engine, done with what was in flight, began loading it (NaN: not seen
    by the watcher but read from weights:latest)."""
    blob, seen_at = state.seen
    if blob != state.acted_on:
        return math.nan, math.nan
    return max(seen_at - wv.created_at, 0.0), max(loading_at - seen_at, 0.0)
