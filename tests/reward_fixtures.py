"""Reward functions for the scoring tests, importable by name ("tests.reward_fixtures:half") from
the spawned reward workers, which get the test process's sys.path."""

import os
import re
import signal
import subprocess
import time


def half(**_) -> float:
    return 0.5


def slow(**_) -> float:
    """A verifier that takes an hour (a sandbox that hangs)."""
    time.sleep(3600)
    return 1.0


def parts(**_) -> dict[str, float]:
    return {"correct": 1.0, "format": 0.25}


def length(*, completion: str, completion_ids: list[int], **_) -> dict[str, float]:
    """Sees the text and the ids: their lengths as two components."""
    return {"chars": float(len(completion)), "tokens": float(len(completion_ids))}


def moody(*, completion: str, meta: dict, **_) -> float:
    """What the completion says: "raise", "hang" (sleeps), "spin" (a busy loop), "blocked" (in a
    read, its signals blocked), "die" (the process exits), "child" (starts a child process, writes
    its pid to meta["pidfile"], then hangs),
    "nan", "text"; anything else scores 1.0."""
    if completion == "raise":
        raise ValueError("no good")
    if completion == "hang":
        time.sleep(1e9)
    if completion == "spin":
        while True:
            pass
    if completion == "blocked":  # a read nobody will answer, with every signal it can block blocked
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        os.read(os.pipe()[0], 1)
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


def gated(*, meta: dict, **_) -> float:
    """Waits until the file meta["gate"] exists (the test opens the gate), then says which
    process scored it; gives up after 300 s, as a guard against a hang only."""
    deadline = time.monotonic() + 300
    while not os.path.exists(meta["gate"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gate {meta['gate']} never opened")
        time.sleep(0.05)
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


# ---------------------------------------------------------------------- TRL's signature
# Shaped as TRL's GRPOTrainer documentation writes reward functions ("Using a custom reward
# function"): lists in, one float (or None) per completion out, the data set's columns as kwargs.

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format (a chat completion)."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    """The content of \\boxed{} compared with the data set's ground_truth column (a text completion)."""
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth, strict=True)]


def math_only(prompts, completions, task, **kwargs):
    """None for the completions it does not judge (TRL: left out of the weighted sum)."""
    return [float(len(c)) if t == "math" else None for c, t in zip(completions, task, strict=True)]


CALLS: list[dict] = []  # what `counting` was called with, in this process


def counting(prompts, completions, completion_ids, **kwargs):
    """Records its arguments; the number of token ids of each completion."""
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    return [float(len(ids)) for ids in completion_ids]


def too_few(completions, **kwargs):
    return [1.0]


def stuck(completions, **kwargs):
    time.sleep(1e9)


def always(completions, **kwargs):
    """Every completion passes (a TRL function)."""
    return [1.0] * len(completions)


def asked_two_plus_two(*, prompt: str, **_) -> float:
    """1.0 when the reward is shown "What is 2 + 2?" as the prompt (the last user message)."""
    return 1.0 if prompt == "What is 2 + 2?" else 0.0


def says(*, completion: str, meta: dict, **_) -> float:
    """1.0 when the completion is exactly the problem's `said` column (a meta column)."""
    return 1.0 if completion == meta["said"] else 0.0
