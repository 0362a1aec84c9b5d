"""The intake stage: take prompts while fewer than `max_in_flight` are held (this consumer's own
pending ones first, then ones idle in a dead generator's list, then new ones), decode and tokenize
them, and send them to the engine loop; until the first signal."""

from __future__ import annotations

import time
from functools import partial

import trio

from generators.prompts import own_pending, prepare_prompts, take_prompts
from generators.state import Generator, Held, State


async def intake(g: Generator, state: State) -> None:
    """Take prompts while there is capacity, own pending ones first, and send them to the engine
    loop; until the first signal."""
    backlog = await trio.to_thread.run_sync(lambda: own_pending(g.r, stream=g.keys.prompts, consumer=g.id))
    if backlog:
        print(f"{g.name}: {len(backlog)} pending prompts of its own", flush=True)
    with g.intake_scope:
        while True:
            while state.benched():  # quarantined by the trainer: what it sampled would be turned away
                await trio.sleep(1.0)
            await g.capacity.acquire()  # where a stop signal finds it waiting
            count = 1
            while count < g.settings.batch_prompts:
                try:
                    g.capacity.acquire_nowait()
                except trio.WouldBlock:
                    break
                count += 1
            with trio.CancelScope(shield=True):  # what is taken from the stream is held
                entries, backlog = backlog[:count], backlog[count:]
                if len(entries) < count:
                    entries += await trio.to_thread.run_sync(partial(
                        take_prompts, g.r, stream=g.keys.prompts, consumer=g.id, count=count - len(entries),
                        claim_idle_ms=int(g.settings.claim_idle_s * 1000), wait=not entries))
                # A prompt it holds comes back when it went claim_idle_s without a touch (a heartbeat
                # that fell behind on a loaded machine) and this generator reclaimed it from itself:
                # it is in the engine already, and sampling it twice would write two groups.
                entries = [e for e in entries if e[0].decode() not in state.held]
                work = await trio.to_thread.run_sync(partial(
                    prepare_prompts, g.r, g.engine, entries, keys=g.keys, name=g.name,
                    max_new_tokens=g.sampling.max_new_tokens, limits=g.limits))
                now = time.perf_counter()
                for entry_id, task, ids in work:
                    held = Held(entry_id=entry_id, task=task, prompt_ids=ids, taken_at=now)
                    state.held[entry_id.decode()] = held
                    g.arrived_send.send_nowait(held)
                for _ in range(count - len(work)):
                    g.capacity.release()
    await g.arrived_send.aclose()
