import redis

from common.audit import accounting, unaccounted
from common.cli import status_lines
from common.deadletters import DeadLetter, count_dead_letters, dead_letter, read_dead_letters
from common.keys import GENERATORS_GROUP, PAYLOAD, TRAINER_GROUP, Keys
from common.streams import connect, ensure_group, group_backlog, lost_redis, redacted
from tests.harness.servers import free_port, start_redis


def test_passwords_never_reach_the_logs():
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("rediss://:secret@host") == "rediss://:***@host"
    assert redacted("redis://127.0.0.1:6390/0") == "redis://127.0.0.1:6390/0"
    assert "secret" not in lost_redis("trainer", "redis://:secret@h:1/0", ConnectionError("refused"))


def test_groups_are_created_once_and_dead_letters_keep_the_payload(redis_url):
    r = connect(redis_url)
    keys = Keys("s")
    ensure_group(r, keys.samples, "trainer")
    ensure_group(r, keys.samples, "trainer")  # a second process starting: no error
    assert [g["name"] for g in r.xinfo_groups(keys.samples)] == [b"trainer"]
    with r.pipeline(transaction=True) as pipe:
        dead_letter(pipe, keys.samples_dead, DeadLetter.of(source=keys.samples, entry_id=b"1-0",
                                                           entry={PAYLOAD: b"\x00junk"}, reason="not MessagePack"))
        dead_letter(pipe, keys.samples_dead, DeadLetter.of(source=keys.samples, entry_id="2-0", entry={},
                                                           reason="x" * 5000))
        pipe.execute()
    first, second = r.xrange(keys.samples_dead)
    assert first[1] == {b"source": keys.samples.encode(), b"entry_id": b"1-0", b"reason": b"not MessagePack",
                        b"payload": b"\x00junk"}
    assert read_dead_letters(r, keys.samples_dead) == [
        DeadLetter(source=keys.samples, entry_id="1-0", reason="not MessagePack", payload=b"\x00junk"),
        DeadLetter(source=keys.samples, entry_id="2-0", reason="x" * 2000, payload=b"")]
    assert count_dead_letters(r, keys.samples_dead) == 2
    assert "dead 2" in status_lines(r, "s")[3], status_lines(r, "s")


def test_what_waits_in_a_stream_is_counted_after_redis_replays_its_append_only_file(tmp_path):
    """Redis 7.0 forgets a group's read counter when it replays its append-only file, and reports
    no lag until the group reaches the last entry: the audit and `rollouts status` still count
    the entries not yet delivered."""
    port, data = free_port(), tmp_path / "redis"
    keys = Keys("replayed")
    server = start_redis(data, port)
    try:
        r = redis.Redis(port=port)
        ensure_group(r, keys.prompts, GENERATORS_GROUP)
        ensure_group(r, keys.samples, TRAINER_GROUP)
        for i in range(2500):  # more than one page of the count
            r.xadd(keys.prompts, {PAYLOAD: str(i)})
        r.xadd(keys.samples, {PAYLOAD: b"g"})
        read = r.xreadgroup(GENERATORS_GROUP, "gen", {keys.prompts: ">"}, count=7)[0][1]
        r.xack(keys.prompts, GENERATORS_GROUP, read[0][0])
        assert group_backlog(r, keys.prompts, GENERATORS_GROUP) == (6, 2493)
        server.terminate()
        server.wait(timeout=10)
        server = start_redis(data, port)
        assert group_backlog(r, keys.prompts, GENERATORS_GROUP) == (6, 2493)
        assert group_backlog(r, keys.samples, TRAINER_GROUP) == (0, 1)  # nobody has read it
        acc = accounting(r, keys)
        assert (acc["prompts_pending"], acc["prompts_waiting"], acc["samples_waiting"]) == (6, 2493, 1)
        assert any("waiting 2493  in flight 6" in line for line in status_lines(r, "replayed"))
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_copies_of_a_trained_group_left_in_the_stream_count_as_duplicates_not_pending(r):
    """A generator cut off past claim_idle_s writes copies of prompts another generator took over
    (trained, or not yet); written after the trainer stopped they wait in the samples stream. The
    audit counts them as groups made twice, not as prompts still to train (the trainer refuses them
    when it reads them)."""
    import msgpack

    keys = Keys("copies")
    ensure_group(r, keys.samples, TRAINER_GROUP)
    trained = r.xadd(keys.samples, {PAYLOAD: msgpack.packb({"id": "p1"})})
    r.xreadgroup(TRAINER_GROUP, "rank0", {keys.samples: ">"}, count=1)
    r.xack(keys.samples, TRAINER_GROUP, trained)
    r.zadd(keys.trained, {"p1": 1})
    r.hset(keys.trainer, mapping={"step": 1, "groups_trained": 1})
    r.xadd(keys.samples, {PAYLOAD: msgpack.packb({"id": "p1"})})  # a copy, read and not yet turned away
    r.xreadgroup(TRAINER_GROUP, "rank0", {keys.samples: ">"}, count=1)
    r.xadd(keys.samples, {PAYLOAD: msgpack.packb({"id": "p2"})})  # a group still to train
    r.xadd(keys.samples, {PAYLOAD: msgpack.packb({"id": "p2"})})  # and its copy
    r.xadd(keys.samples, {PAYLOAD: msgpack.packb({"id": "p1"})})  # a copy waiting
    r.xadd(keys.samples, {PAYLOAD: b"\x00junk"})  # no id: pending until the trainer dead-letters it
    acc = accounting(r, keys)
    assert (acc["samples_pending"], acc["samples_waiting"]) == (1, 4)
    assert (acc["duplicate_unread"], acc["duplicate_refused"], acc["duplicate"]) == (3, 0, 3)
    assert acc["pending"] == 2
    assert not [line for line in unaccounted(acc) if line.startswith("group entries")], unaccounted(acc)
    assert "3 group(s) made twice from one prompt" in unaccounted(acc)


def test_a_process_started_before_redis_waits_for_it_and_says_so(tmp_path, capsys):
    """README "GPUs": the trainer started beside `./ops/run ... &` may come up long before Redis
    (./ops/run installs and prepares the model first); it waits, saying so once, then connects."""
    import threading

    port, servers = free_port(), []
    late = threading.Timer(5.0, lambda: servers.append(start_redis(tmp_path, port)))
    late.start()
    try:
        r = connect(f"redis://127.0.0.1:{port}/0", wait_s=60)
        assert r.ping()
        assert capsys.readouterr().err.count(f"waiting up to 60 s for Redis at redis://127.0.0.1:{port}/0") == 1
    finally:
        late.join()
        for s in servers:
            s.terminate()
            s.wait(timeout=10)


def test_weights_written_back_after_redis_lost_them_keep_the_stream_capped(r):
    """The trainer's one announcement of weights (common.streams.announce_weights) caps the
    weights stream, also where it writes its record back into a Redis that lost writes."""
    from common.keys import WEIGHTS_MAXLEN
    from common.messages import WeightVersion, encode
    from common.streams import announce_weights, latest_weights
    from trainer.record import Record, put_right

    keys = Keys("capped")
    with r.pipeline(transaction=False) as pipe:
        for version in range(2 * WEIGHTS_MAXLEN):
            pipe.xadd(keys.weights, {PAYLOAD: encode(WeightVersion(version=version, step=version, path=f"/c/{version}",
                                                                   format="safetensors", checksums={},
                                                                   created_at=0.0))})
        pipe.execute()
    newest = WeightVersion(version=7, step=7, path="/c/step_7", format="safetensors", checksums={"a": "1"},
                           created_at=1.0)
    put_right(r, keys, Record(step=7, version=7, state_step=7, groups_trained=3, latest=newest))
    assert WEIGHTS_MAXLEN <= r.xlen(keys.weights) < 2 * WEIGHTS_MAXLEN, r.xlen(keys.weights)
    assert latest_weights(r, keys) == newest
    with r.pipeline(transaction=True) as pipe:
        announce_weights(pipe, keys, newest)
        pipe.execute()
    [(_, last)] = r.xrevrange(keys.weights, count=1)
    assert last == {PAYLOAD: encode(newest)}
