"""Environments for tests, loaded by name ("tests.env_fixtures:...") in the environment workers."""

from __future__ import annotations

import os
import time
from typing import Any

from envs.base import Step
from envs.tools import Call, call_tools


def _hang(text: str) -> str:
    time.sleep(3600)
    return text


def _boom(text: str) -> str:
    raise RuntimeError("boom")


class Faulty:
    """A tool environment whose tool (meta["tool"]: "hang" or "boom") misbehaves on the episode's
    first call; once a call has answered, the next turn ends the episode with reward 1. A hang
    leaves the state as it was, so a hanging tool is called again on every turn."""

    system = "Call the tool."
    error_role = "tool"

    @staticmethod
    def start(meta: dict[str, Any]) -> dict[str, Any]:
        return {"tool": meta["tool"], "answered": False}

    @staticmethod
    def step(state: dict[str, Any], text: str) -> Step:
        if state["answered"]:
            return Step(state=state, done=True, reward=1.0, rewards={"done": 1.0})
        answers = call_tools([Call(name=state["tool"], arguments=text)], {"hang": _hang, "boom": _boom})
        return Step(state={**state, "answered": True}, messages=[{"role": "tool", "content": a} for a in answers])


class Echo:
    """Answers every turn with a tool message and never ends the episode (limits end it)."""

    system = None

    @staticmethod
    def start(meta: dict[str, Any]) -> int:
        return 0

    @staticmethod
    def step(state: int, text: str) -> Step:
        return Step(state=state + 1, messages=[{"role": "tool", "content": f"turn {state}: 12 + 34"}],
                    reward=0.25, rewards={"turn": 0.25})


class BadStart:
    system = None

    @staticmethod
    def start(meta: dict[str, Any]) -> int:
        raise KeyError("no such game")

    @staticmethod
    def step(state: int, text: str) -> Step:
        return Step(state=state, done=True)


class HangOnce:
    """Hangs in its first step until the process is killed, the first time any episode of the run
    plays it (meta["marker"] is a file that says it happened); afterwards ends each episode at once."""

    system = None

    @staticmethod
    def start(meta: dict[str, Any]) -> str:
        return meta["marker"]

    @staticmethod
    def step(state: str, text: str) -> Step:
        import os

        try:
            fd = os.open(state, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return Step(state=state, done=True, reward=1.0)
        os.close(fd)
        time.sleep(3600)
        return Step(state=state, done=True)


class FirstStartFails:
    """The first episode of a prompt to start finds no environment (start raises: a reward error);
    the others end at their first turn with reward 1. meta["flag"] names a file: the start that
    creates it raises."""

    system = None

    @staticmethod
    def start(meta: dict[str, Any]) -> int:
        try:
            os.close(os.open(meta["flag"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return 0
        raise RuntimeError("no environment for the first episode")

    @staticmethod
    def step(state: int, text: str) -> Step:
        return Step(state=state, done=True, reward=1.0, rewards={"done": 1.0})


class Chat:
    """Answers every model turn as the user ("Go on."), its failures as a tool (the default
    error_role), and never ends the episode (limits end it): a chat partner, as a game is."""

    system = None

    @staticmethod
    def start(meta: dict[str, Any]) -> int:
        return 0

    @staticmethod
    def step(state: int, text: str) -> Step:
        return Step(state=state + 1, messages=[{"role": "user", "content": "Go on."}])
