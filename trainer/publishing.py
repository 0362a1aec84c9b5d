"""The trainer's publishing stages: the weights of a step (and, with them, the trainer state and the
acknowledgement of the groups trained since the last) every `sync_every` steps, again when the
published checkpoint is gone, and a publish that could not be written (trainer/checkpoints.py
writes the files and the transaction).

A version is written beside the next step (trainer.publish_in_background): the step copies its
weights to the host (`published_tensors`; where they are the parameters themselves, the next
optimizer update waits for their write instead) and, with the trainer state, the optimizer's
state and the weights again (`staged`, into a host buffer each save reuses); rank 0's writer
thread writes the checkpoint and announces it (`announce_version`) as soon as it is written, and
with a trainer state each rank's state thread writes its shards (`write_state`, over a gloo group
of their own), after which rank 0's records the saved state and acknowledges the groups it holds
(`announce_state`, after the version's announcement). The trainer waits for a version's write
(`settle_weights`) before its next publish, and for a state's (`settle_writing`) before its next
save, a publish in the step, and at its end: a state takes a few steps' time to write (4.3 GB for
Qwen2.5-0.5B in float32 with AdamW's moments), and neither the generators, which load the version
at once, nor the next steps wait for it. A trainer killed while writing loses nothing: a version
not written is not announced, the groups of a state not written are not acknowledged, and a
restart resumes from the newest saved state as after a kill anywhere else."""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from common.evals import enqueue_eval
from common.messages import WeightVersion
from common.progress import Fault, count_fault, note_same, write_step
from common.streams import announced_before, latest_weights
from trainer.checkpoints import (
    announce_state,
    announce_version,
    hold_for_eval,
    publish,
    published_tensors,
    remove_unfinished,
    write_weights,
)
from trainer.devices import DTYPES
from trainer.parallel import any_rank, is_main, say, writer_group
from trainer.run import Run, Writing
from trainer.state import begin_state, prune_states, staged, state_dir, write_state


class PublishFailed(RuntimeError):
    """A checkpoint or trainer state could not be written (a full disk): nothing of it was announced
    (of a state written beside the steps, only its version), and the trainer stops; the text says
    where a restart resumes."""


def checkpoint(run: Run, *, save: bool, background: bool = False) -> WeightVersion | None:
    """Publish the weights of `run.step` (every rank takes part); with `save`, the trainer state
    too, and acknowledge every group trained since the last. Rank 0 alone gets the WeightVersion.
    The version being written beside the step, if any, is settled first. `background`: written by
    the writer threads while the trainer goes on (`write_beside`); nothing is returned
    (`settle_writing` gives it)."""
    cfg, config = run.config.trainer, run.config
    if save or not background:  # one state written at a time (into the one host buffer), in order
        settle_writing(run)
    else:
        settle_weights(run)
        # a state whose write failed stops the trainer now, on every rank together (each learns
        # of its own write's failure in its own time), not at the next save
        if any_rank(run.saving is not None and run.saving.done.done() and run.saving.done.exception() is not None):
            settle_saving(run)
    newest = state_dir(run.state_root, run.record.state_step)
    if any_rank(run.record.state_step > 0 and not newest.is_dir()):
        save = True  # a restart would have nothing to resume from: save one now
        if is_main():
            count_fault(run.r, run.keys, Fault.STATE_LOST)
        say(f"trainer: its newest saved state {newest} is gone (the output directory deleted?); "
            f"saving the trainer state of step {run.step} now")
    if background:
        write_beside(run, save=save)
        return None
    try:
        wv = publish(run.r, run.keys, run.model, run.optimizer, run.scheduler, step=run.step,
                     checkpoint_dir=config.checkpoint_dir, state_root=run.state_root, source_dir=run.source_dir,
                     keep=cfg.keep_checkpoints, save_state_now=save,
                     entry_ids=run.unacked_entries if save else [], group_ids=run.unacked_ids if save else [],
                     dedup_window=cfg.dedup_window, dtype=DTYPES[config.model.dtype],
                     gone_back=run.record.gone_back[-1] if run.record.gone_back else None, sender=run.sender,
                     adapter=cfg.lora.rank > 0 and cfg.lora.publish == "adapter")
    except OSError as err:  # a full disk, most often: nothing was announced
        raise publish_failed(run, err) from err
    run.record.published(wv, step=run.step, saved=save, group_ids=run.unacked_ids if save else [],
                         dedup_window=cfg.dedup_window)
    note_if_unchanged(run, wv)
    if save:
        run.unacked_entries, run.unacked_ids = [], []
    return wv


def write_beside(run: Run, *, save: bool = False) -> None:
    """Start publishing `run.step` beside the steps that follow: its weights on the host now (a copy,
    gathered from every rank; in one process whose weights are on the CPU in the published dtype,
    the parameters themselves, and the next optimizer update waits until they are written), then
    written and announced by rank 0's writer thread, with the evaluation queued where `eval.every`
    asks for it. With `save`, the trainer state is copied into host memory too (`staged`; the state
    before it settled by `checkpoint`), each rank's state thread writes its shards of it, and rank
    0's then acknowledges every group trained since the last saved state (after the version's
    announcement)."""
    cfg, config, step = run.config.trainer, run.config, run.step
    adapter = cfg.lora.rank > 0 and cfg.lora.publish == "adapter"
    tensors = published_tensors(run.model, DTYPES[config.model.dtype], adapter=adapter)
    gone_back = run.record.gone_back[-1] if run.record.gone_back else None
    entries, ids = (list(run.unacked_entries), list(run.unacked_ids)) if save else ([], [])
    device = next(run.model.parameters()).device  # a DTensor's: its shard's
    state, tmp = None, None
    if save:  # a copy: the steps after it change the optimizer's state while it is written
        state, tmp = begin_state(run.model, run.optimizer, run.scheduler, step=step, state_root=run.state_root)
        state, run.staged = staged(state, run.staged, cuda=device.type == "cuda")
    group = writer_group() if save else None  # a collective, the first time
    weights_written: Future = Future()

    def on_device() -> None:
        if device.type == "cuda":  # a new thread's CUDA device is GPU 0: dcp's copies to the host go on this rank's
            torch.cuda.set_device(device)

    def write() -> WeightVersion:
        on_device()
        try:
            written = write_weights(run.model, tensors, step=step, checkpoint_dir=config.checkpoint_dir,
                                    source_dir=run.source_dir, keep=cfg.keep_checkpoints, adapter=adapter)
        finally:  # however it ended: a failure is settle_weights's to report
            weights_written.set_result(None)
        wv = announce_version(run.r, run.keys, written, step=step, state_saved=False, entry_ids=[], group_ids=[],
                              dedup_window=cfg.dedup_window, gone_back=gone_back, adapter=adapter)
        queue_eval(run, wv)
        return wv

    done, hold = None, None
    if is_main():
        if run.writer is None:
            run.writer = ThreadPoolExecutor(1, thread_name_prefix="publish")
        done = run.writer.submit(write)
        if shares_memory(tensors, run.model):  # a copy would cost more than the wait (0.3 s a step, default model)
            hold = hold_updates(run.optimizer, weights_written)
    run.writing = Writing(step=step, done=done, hold=hold)
    if state is None:
        return

    def save_state() -> None:
        on_device()
        write_state(state, tmp=tmp, step=step, state_root=run.state_root, keep=cfg.keep_checkpoints, group=group)
        if done is not None:
            done.result()  # the version announced first (its failure is settle_weights's to report)
            announce_state(run.r, run.keys, step=step, entry_ids=entries, group_ids=ids,
                           dedup_window=cfg.dedup_window)

    if run.state_writer is None:
        run.state_writer = ThreadPoolExecutor(1, thread_name_prefix="save-state")
    run.saving = Writing(step=step, done=run.state_writer.submit(save_state), entries=len(entries),
                         ids=len(ids))


def shares_memory(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    """Whether any of `tensors` is (a view of) one of `model`'s parameters. FSDP2's parameters are
    DTensor shards, whose gathered weights are new tensors: they share nothing."""
    params = {storage_of(p) for p in model.parameters()} - {None}
    return any(storage_of(t) in params for t in tensors.values())


def storage_of(t: torch.Tensor) -> int | None:
    """The address of `t`'s storage; None for a tensor without one of its own (a DTensor)."""
    if isinstance(t, DTensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor subclass whose storage cannot be read
        return None


def hold_updates(optimizer: torch.optim.Optimizer, done: Future) -> RemovableHandle:
    """Make `optimizer`'s updates wait until `done` (a write reading the parameters themselves) has
    ended, however it ended (a failure is `settle_writing`'s to report). Removed when settled."""
    def wait(_optimizer: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
        concurrent.futures.wait([done])

    return optimizer.register_step_pre_hook(wait)


def settle_writing(run: Run) -> None:
    """Wait for the version and the trainer state being written beside the step, if any, and
    record them as published and saved."""
    settle_weights(run)
    settle_saving(run)


def settle_weights(run: Run) -> None:
    """Wait for the version being written beside the step, if any, and record it as published;
    a write that failed (a full disk) stops the trainer as a publish in the step would. A trainer
    state being written is left to it (`settle_saving`)."""
    writing, run.writing = run.writing, None
    if writing is not None:
        try:
            wv = writing.done.result() if writing.done is not None else None
        except OSError as err:  # a full disk, most often: nothing was announced, nothing acknowledged
            raise publish_failed(run, err, step=writing.step) from err
        finally:
            if writing.hold is not None:
                writing.hold.remove()
        run.record.published(wv, step=writing.step, saved=False, group_ids=[],
                             dedup_window=run.config.trainer.dedup_window)


def settle_saving(run: Run) -> None:
    """Wait for the trainer state being written beside the steps, if any, and record its groups
    as acknowledged; a write that failed stops the trainer, its groups still pending."""
    saving, run.saving = run.saving, None
    if saving is None:
        return
    try:
        saving.done.result()
    except OSError as err:  # a full disk, most often: its version may be announced, its groups are not
        raise publish_failed(run, err, step=saving.step, state=True) from err
    ids = run.unacked_ids[:saving.ids]
    run.record.saved(step=saving.step, group_ids=ids, dedup_window=run.config.trainer.dedup_window)
    # the groups trained since stay unacknowledged, for the next saved state
    run.unacked_entries = run.unacked_entries[saving.entries:]
    run.unacked_ids = run.unacked_ids[saving.ids:]


def in_background(run: Run) -> bool:
    """Whether a publish may be written beside the next step: asked for
    (trainer.publish_in_background), on disk only (no broadcast), and outside a go-back's versions
    (note_if_unchanged compares each with what was published before under its number). The same
    on every rank."""
    gone = run.record.gone_back[-1] if run.record.gone_back else None
    return (run.config.trainer.publish_in_background and run.config.trainer.weight_transfer == "disk"
            and (gone is None or not gone.step < run.step <= gone.upto))


def queue_eval(run: Run, wv: WeightVersion | None) -> None:
    """Queue the evaluation of `wv` where `eval.every` divides its version (rank 0's)."""
    every = run.config.eval.every
    if wv is not None and every and wv.version % every == 0:
        enqueue_eval(run.r, run.config, hold_for_eval(wv))  # the evaluator process scores it on held-out problems


def note_if_unchanged(run: Run, wv: WeightVersion | None) -> None:
    """After a publish below the version the trainer had reached before it went back: when the
    weights are those it had published under that number (it trained the same groups again in the
    same order, so the update is bit-identical: the usual case after a kill between saved states),
    the groups sampled with them were not sampled with abandoned weights, and are trained. Every
    rank learns it (`collect` runs on each); rank 0 records it in Redis. A collective, only for a
    step within the go-back (the same on every rank)."""
    gone = run.record.gone_back[-1] if run.record.gone_back else None
    if gone is None or not gone.step < run.step <= gone.upto:  # every rank alike: no collective
        return
    unchanged = False
    if wv is not None:
        before = announced_before(run.r, run.keys, wv.version, before=gone.at)
        unchanged = before is not None and before.checksums == wv.checksums
    if not any_rank(unchanged):
        return
    run.record.gone_back[-1] = gone = replace(gone, same=[*gone.same, run.step])
    if is_main():
        note_same(run.r, run.keys, gone)
        say(f"trainer: version {run.step} published again with the weights it had before: the groups sampled "
            "with them are trained")


def publish_failed(run: Run, err: OSError, *, step: int | None = None, state: bool = False) -> PublishFailed:
    """Count a publish (of `step`; None: `run.step`) whose files could not be written (`state`: the
    trainer state written beside the steps, its version announced before), remove what it half
    wrote (space a full disk needs back), and say what stands: the weights generators have, the
    state a restart resumes from. Every group trained since that state is still pending, to be
    trained again."""
    remove_unfinished(run.config.checkpoint_dir)
    prune_states(run.state_root, keep=run.config.trainer.keep_checkpoints)  # its half-written state
    if is_main():
        count_fault(run.r, run.keys, Fault.PUBLISH_FAILED)
    step = run.step if step is None else step
    stands = (f"Its weights were announced (generators have version {run.record.version})" if state
              else f"Nothing was announced: generators keep version {run.record.version}")
    return PublishFailed(
        f"{'saving the trainer state of' if state else 'publishing'} step {step} failed: {err}. {stands}, and the "
        f"groups trained since the saved state of step {run.record.state_step} stay pending. Stopping; free "
        f"the space and start the trainer again: it resumes from that state")


def publish_if_due(run: Run, *, last: bool) -> None:
    """After a step: publish every `sync_every` steps and at the `last`, saving the trainer state
    every `state_every` (and at the last), and queue the evaluation of every `eval.every`-th
    version; between publishes rank 0 records the step alone."""
    cfg = run.config.trainer
    if run.step % cfg.sync_every == 0 or last:
        run.version = run.step
        save = run.step % (cfg.state_every or cfg.sync_every) == 0 or last
        # the last in the step: no step follows it to write beside
        queue_eval(run, checkpoint(run, save=save, background=in_background(run) and not last))
    else:
        settle_weights(run)  # the version written beside this step announced before the step is recorded
        if is_main():
            write_step(run.r, run.keys, step=run.step)
            run.record.step = run.step


def republish_if_gone(run: Run, *, agree: bool) -> None:
    """Publish the weights of `run.step` again when the newest published checkpoint's directory
    is gone (deleted, the output directory with it): generators cannot load it and go on sampling
    with older weights, whose groups soon all grow too stale to train, so that no step would ever
    end. `agree`: every rank decides together (a collective); else rank 0 decides alone, which
    only a trainer of world size 1 may (between reads, while a step waits for groups)."""
    latest = latest_weights(run.r, run.keys) if is_main() else None
    gone = latest is not None and not Path(latest.path).is_dir()
    if agree:
        gone = any_rank(gone)
    if not gone:
        return
    if latest is not None:
        count_fault(run.r, run.keys, Fault.WEIGHTS_LOST)
        say(f"trainer: the published checkpoint {latest.path} (version {latest.version}) is gone and generators "
            f"cannot load it; publishing the weights of step {run.step} again")
    run.version = run.step
    checkpoint(run, save=True)
