from common.keys import PAYLOAD, Keys
from common.streams import connect, dead_letter, ensure_group, lost_redis, redacted


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
        dead_letter(pipe, dead_stream=keys.samples_dead, source=keys.samples, entry_id=b"1-0",
                    fields={PAYLOAD: b"\x00junk"}, reason="not MessagePack")
        pipe.execute()
    [(_, entry)] = r.xrange(keys.samples_dead)
    assert entry == {b"source": keys.samples.encode(), b"entry_id": b"1-0", b"reason": b"not MessagePack",
                     b"payload": b"\x00junk"}
