"""Reward functions for the scoring tests, importable by name ("tests.reward_fixtures:half") from
the spawned reward workers, which get the test process's sys.path."""

import os
import subprocess
import time


def half(**_) -> float:
    return 0.5


def parts(**_) -> dict[str, float]:
    return {"correct": 1.0, "format": 0.25}


def length(*, completion: str, completion_ids: list[int], **_) -> dict[str, float]:
    """Sees the text and the ids: their lengths as two components."""
    return {"chars": float(len(completion)), "tokens": float(len(completion_ids))}


def moody(*, completion: str, meta: dict, **_) -> float:
    """What the completion says: "raise", "hang" (sleeps), "spin" (a busy loop), "die" (the process
    exits), "child" (starts a child process, writes its pid to meta["pidfile"], then hangs),
    "nan", "text"; anything else scores 1.0."""
    if completion == "raise":
        raise ValueError("no good")
    if completion == "hang":
        time.sleep(1e9)
    if completion == "spin":
        while True:
            pass
    if completion == "die":
        os._exit(3)
    if completion == "child":
        child = subprocess.Popen(["sleep", "1000"])
        with open(meta["pidfile"], "w") as f:
            f.write(str(child.pid))
        time.sleep(1e9)
    if completion == "nan":
        return float("nan")
    if completion == "text":
        return "1.0"  # type: ignore[return-value]
    return 1.0


def slow_pid(*, meta: dict, **_) -> float:
    """Sleeps meta["sleep"] seconds, then says which process scored it."""
    time.sleep(meta["sleep"])
    return float(os.getpid())


def rendezvous(*, completion: str, meta: dict, **_) -> float:
    """Waits (up to 20 s) until meta["parties"] calls have arrived in the folder meta["dir"], then
    says which process scored it: it returns only if that many rewards run at the same time."""
    folder = meta["dir"]
    open(os.path.join(folder, f"{os.getpid()}-{completion}"), "w").close()
    deadline = time.monotonic() + 20
    while len(os.listdir(folder)) < meta["parties"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(os.listdir(folder))} of {meta['parties']} arrived")
        time.sleep(0.01)
    return float(os.getpid())


def hang_once_started(*, meta: dict, **_) -> float:
    """Creates the file meta["started"], then hangs: the caller knows the reward is running."""
    open(meta["started"], "w").close()
    time.sleep(1e9)
    return 0.0


def answer_and_format(**kw) -> dict[str, float]:
    """Two built-ins combined, as the `tasks` package docstring shows: correctness plus a small
    format bonus."""
    from tasks import format, gsm8k

    return {**gsm8k.reward(**kw), "format": 0.1 * format.reward(**kw)["format"]}


def by_mood(*, meta: dict, **_) -> float:
    """`moody` acting on the prompt's meta["mood"] instead of the completion's text."""
    return moody(completion=meta["mood"], meta=meta)
