"""Stalls and disk faults on the real processes (tiny model): a trainer stopped while it holds
unacknowledged groups, its output directory deleted under it, its checkpoint disk full at a publish.
Each ends with the accounting of tests/test_faults.py: nothing trained twice, nothing lost. Run with
-s to see the numbers."""

import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from common.checkpoints import verify_dir
from common.heartbeats import read_counters, read_heartbeat
from common.keys import GENERATORS_GROUP, PAYLOAD, TRAINER_GROUP, Keys
from common.messages import decode_group, encode
from common.progress import read_trainer
from common.streams import connect, latest_weights
from tests.harness.audit import accounting, assert_accounted
from tests.harness.groups import ask
from tests.harness.http import JsonHandler, serving
from tests.harness.needs import skip_without_root
from tests.harness.pipeline import KEYS, Pipeline, metrics, pipeline_config, trained_once
from tests.harness.processes import spawn, stop, wait_for


def groups_held_by_trainer(r) -> int:
    return r.xpending(KEYS.samples, TRAINER_GROUP)["pending"]


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs mounted at the run's checkpoint directory (root only: skipped otherwise,
    failed in CI, tests.harness.needs.skip_without_root)."""
    where = tmp_path / "run" / "checkpoints"
    where.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        skip_without_root(f"cannot mount a small tmpfs to fill (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> Path:
    """Write zeros into `disk` until it is full; the filler file."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_disk_at_publish_announces_nothing_and_the_trainer_stops_resumably(
        tmp_path, redis_url, tiny_model, small_disk):
    r = connect(redis_url)  # retries a reply slow on a loaded machine, as the processes do
    steps = 30
    # Every checkpoint is kept (the tiny model's are 0.5 MB: 30 fit), so that nothing frees space on
    # the full disk: filled between a publish's writing and its pruning of the oldest checkpoint, the
    # disk would get back just what the next publish needs, and the run would go on to its end.
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=steps, state_every=2,
                                           keep_checkpoints=steps))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    wait_for(lambda: any(m["step"] == 3 for m in metrics(tmp_path)), timeout=180, what="step 3",
             procs=list(pipe.procs.values()))
    filler = fill(small_disk)
    trainer = pipe.procs["trainer"]
    wait_for(lambda: trainer.poll() is not None, timeout=120, what="the trainer to stop at the full disk",
             procs=[pipe.procs["producer"], pipe.procs["generator"]])
    log = pipe.log("trainer").read_text()
    assert trainer.returncode == 1, log[-3000:]
    assert "No space left on device" in log and "Nothing was announced" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    stopped = accounting(r, KEYS)
    t = r.hgetall(KEYS.trainer)
    progress = {k.decode(): int(v) for k, v in t.items()}
    assert progress["publish_failed"] == 1, progress
    latest = latest_weights(r, KEYS)
    assert latest.version == progress["version"] < steps
    verify_dir(latest.path, latest.checksums)  # what generators have is whole
    assert not list(small_disk.glob(".step_*.tmp")), "a half-written checkpoint was left on the full disk"
    assert (tmp_path / "run" / "trainer_state" / f"step_{progress['state_step']}").is_dir()
    print(f"\nfull disk: the trainer stopped at step {progress['step']} (published {progress['version']}, saved state "
          f"{progress['state_step']}); {groups_held_by_trainer(r)} groups pending for it")

    filler.unlink()  # space again: the trainer resumes from its saved state
    pipe.start("trainer")
    pipe.finish()
    after = accounting(r, KEYS)
    assert_accounted(after)
    assert after["dropped_stale"] == 0
    assert "from its trainer state" in pipe.log("trainer").read_text()
    assert after["trained"] == len(trained_once(r, tmp_path, steps)) == steps * 4
    assert stopped["trained"] <= after["trained"]


def still(r) -> int | None:
    """The trainer's step if it stays the same for 3 s (the trainer waits for groups), else None."""
    before = r.hget(KEYS.trainer, "step")
    time.sleep(3)
    return int(before) if before == r.hget(KEYS.trainer, "step") else None


def test_the_trainers_output_directory_deleted_mid_run_is_written_again(tmp_path, redis_url, tiny_model):
    """The output directory removed while the trainer waits for groups (its generator stopped, so that
    no publish is half-way). Generators could not load the newest weights and would sample with
    older ones, whose groups soon all grow too stale to train: the trainer, waiting, publishes its
    weights again at once, with its state (both counted), and the run goes on to its end."""
    r = connect(redis_url)  # retries a reply slow on a loaded machine, as the processes do
    steps = 8
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=steps, state_every=2))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    wait_for(lambda: any(m["step"] == 3 for m in metrics(tmp_path)), timeout=180, what="step 3",
             procs=list(pipe.procs.values()))
    gen = pipe.procs["generator"]
    gen.send_signal(signal.SIGSTOP)
    try:
        # the trainer runs out of groups (admission holds the producer back) and waits
        step = wait_for(lambda: still(r), timeout=60, what="the trainer waiting for groups")
        # Gone at once, as the trainer sees it: removing the files one by one raced the trainer
        # noticing the loss half-way and writing again into what was still being removed
        # ("Directory not empty", seen once in a full run on a loaded machine).
        (tmp_path / "run").rename(tmp_path / "run.deleted")
        shutil.rmtree(tmp_path / "run.deleted")
        # The generator stays stopped until the trainer, still waiting, has published again: let go
        # sooner, it could deliver groups of the older weights before the trainer's next look, and
        # the step they make would publish (and save) anew without the deletion ever being noticed.
        wait_for(lambda: "generators cannot load it" in pipe.log("trainer").read_text(), timeout=60,
                 what="the trainer publishing again", procs=[pipe.procs["trainer"]])
    finally:
        gen.send_signal(signal.SIGCONT)
    pipe.finish()
    log = pipe.log("trainer").read_text()
    assert "is gone and generators cannot load it; publishing the weights of step" in log, log[-3000:]
    assert "is gone (the output directory deleted?)" in log, log[-3000:]
    after = accounting(r, KEYS)
    assert_accounted(after)
    progress = {k.decode(): int(v) for k, v in r.hgetall(KEYS.trainer).items()}
    assert progress["weights_lost"] == 1 and progress["state_lost"] == 1, progress
    assert progress["step"] == steps
    # written again: the state a restart needs, and the metrics of the steps after the deletion
    assert (tmp_path / "run" / "trainer_state" / f"step_{progress['state_step']}").is_dir()
    assert [m["step"] for m in metrics(tmp_path)] == list(range(step + 1, steps + 1))
    assert after["trained"] == steps * 4


# ---------------------------------------------------------------------- an engine request that never finishes


@pytest.fixture
def silent_server():
    """URL of an HTTP server that lists a model and accepts every completion request, then never
    answers it (a server wedged mid-request); the number of requests it took."""
    taken, release = [], threading.Event()

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            self.reply_json({"data": [{"id": "m", "max_model_len": 512}]})

        def do_POST(self) -> None:
            self.read_json()
            taken.append(self.path)
            release.wait()  # never answers while the test runs

    with serving(Handler, release) as url:
        yield url, taken


def test_a_request_the_server_never_answers_comes_back_failed(silent_server, tiny_model):
    from engines.base import SamplingSettings
    from engines.openai_engine import OpenAIEngine

    url, taken = silent_server
    engine = OpenAIEngine(url, tiny_model, timeout_s=1.0)
    engine.add("p1", [1, 2, 3], SamplingSettings(n=2, max_new_tokens=4, temperature=1.0))
    done, deadline = [], time.monotonic() + 30
    while engine.has_unfinished() and time.monotonic() < deadline:
        done += engine.step()
    assert taken == ["/v1/completions"]
    assert [(f.request_id, f.samples) for f in done] == [("p1", [])]
    assert "no answer within 1 s" in done[0].error
    engine.close()


def test_a_generator_lets_go_of_a_prompt_whose_request_never_finishes(silent_server, tiny_model, tmp_path,
                                                                      redis_url, r):
    """The generator goes on: the failed request is counted in its heartbeat and said in its log, the
    prompt is let go and, once idle claim_idle_s, taken again and tried again; nothing is dead-lettered
    or lost, and a stop is clean."""
    url, taken = silent_server
    keys = Keys("g")
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "g", "ROLLOUTS_MODEL__PATH": str(tiny_model),
           "ROLLOUTS_GENERATOR__ENGINE": "openai", "ROLLOUTS_GENERATOR__SERVER_URL": url,
           "ROLLOUTS_GENERATOR__REQUEST_TIMEOUT_S": "1", "ROLLOUTS_GENERATOR__CLAIM_IDLE_S": "2",
           "ROLLOUTS_ROLLOUT__GROUP_SIZE": "2", "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "4"}
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    r.xadd(keys.prompts, {PAYLOAD: encode(ask(0, n=2))})
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=log)
    try:
        wait_for(lambda: (b := read_heartbeat(r, keys, "g1")) and b.engine_errors >= 2, timeout=120,
                 what="two failed requests counted", procs=[proc])
        assert proc.poll() is None
        assert len(taken) >= 2, "the prompt was not tried again"
        assert r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 1  # still the run's, not lost
        assert r.xlen(keys.samples) == 0 and r.xlen(keys.prompts_dead) == 0
    finally:
        code = stop(proc)
    output = log.read_text()
    assert code == 0, output
    assert "engine request" in output and "no answer within 1 s" in output, output
    assert "let prompt arithmetic:0:0 go" in output, output


# ---------------------------------------------------------------------- a trainer stalled while it holds groups


def test_a_trainer_stopped_holding_unacknowledged_groups_resumes_with_nothing_twice_or_lost(
        tmp_path, redis_url, tiny_model):
    """SIGSTOP the trainer (a stall: swapping, a hung file system, a debugger) while it holds groups
    it trained or read and has not acknowledged (they wait for the next saved state), for longer than
    the generators' claim_idle_s. Generators go on until admission control holds them; the trainer,
    let go on, trains every group once, acknowledges them all, and nothing is left pending."""
    r = connect(redis_url)  # retries a reply slow on a loaded machine, as the processes do
    steps = 12
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=steps, state_every=4,
                                           claim_idle_s=2))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    trainer = pipe.procs["trainer"]

    def stopped_holding() -> list[str] | None:
        if read_trainer(r, KEYS).step < 2 or not groups_held_by_trainer(r):
            return None
        trainer.send_signal(signal.SIGSTOP)
        entries = [p["message_id"] for p in r.xpending_range(KEYS.samples, TRAINER_GROUP, "-", "+", 100)]
        if not entries:
            trainer.send_signal(signal.SIGCONT)
        return [decode_group(r.xrange(KEYS.samples, e, e)[0][1][PAYLOAD]).id for e in entries] or None

    held = wait_for(stopped_holding, timeout=180, what="the trainer holding groups", poll=0.05,
                    procs=list(pipe.procs.values()))
    at_stop = read_trainer(r, KEYS)
    time.sleep(8)  # four times claim_idle_s: generators reclaim among themselves, never the trainer's
    assert all(p.poll() is None for p in pipe.procs.values()), "a process gave up on a stalled trainer"
    assert read_trainer(r, KEYS) == at_stop
    trainer.send_signal(signal.SIGCONT)
    pipe.finish()
    after = accounting(r, KEYS)
    print(f"\ntrainer SIGSTOP: held {len(held)} unacknowledged groups at step {at_stop.step} (saved state "
          f"{at_stop.state_step}); after: admitted {after['admitted']} = trained {after['trained']} + dropped "
          f"{after['dropped']} + pending {after['pending']}")
    assert_accounted(after)
    assert after["dropped_stale"] == 0 and after["duplicate"] == 0, after
    ids = trained_once(r, tmp_path, steps)
    assert after["trained"] == len(ids) == steps * 4
    assert all(ids.count(g) == 1 for g in held), (held, ids)
    assert groups_held_by_trainer(r) == 0, "entries left pending under the trainer"


def test_a_generator_whose_engine_call_overruns_its_deadline_exits_and_its_prompt_is_kept(
        tiny_model, tmp_path, redis_url, r):
    """An in-process engine call cannot be interrupted in its thread: past generator.engine_timeout_s
    (here far shorter than any step, as a step that never returns would be) the generator says so,
    counts it and exits with status 1, leaving its prompt pending for another generator to reclaim."""
    keys = Keys("g")
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "g", "ROLLOUTS_MODEL__PATH": str(tiny_model),
           "ROLLOUTS_GENERATOR__ENGINE": "hf", "ROLLOUTS_GENERATOR__THREADS": "1",
           "ROLLOUTS_GENERATOR__ENGINE_TIMEOUT_S": "0.001",
           "ROLLOUTS_ROLLOUT__GROUP_SIZE": "2", "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "4"}
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    r.xadd(keys.prompts, {PAYLOAD: encode(ask(0, n=2))})
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=log)
    try:
        code = proc.wait(timeout=180)
    finally:
        stop(proc)
    output = log.read_text()
    assert code == 1, output
    assert "did not return within 0.001 s (generator.engine_timeout_s)" in output, output
    assert "Traceback" not in output, output
    assert read_counters(r, keys).engine_stalls == 1
    assert read_heartbeat(r, keys, "g1") is None
    pending = r.xpending_range(keys.prompts, GENERATORS_GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"g1"], "the prompt it held is kept, for another to reclaim"
    assert r.xlen(keys.samples) == 0
