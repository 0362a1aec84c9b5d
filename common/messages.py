"""Wire messages, schema 1: PromptTask, SampleGroup, WeightVersion.

Each stream entry carries one MessagePack map under the field `keys.PAYLOAD`. Every map has
`v` (schema version) and `t` (message type). Token ids travel as packed little-endian int32,
log-probs (the behaviour's, and a teacher's where a group carries them) as packed little-endian
float32, loss masks as packed uint8, a completion's weight versions as packed int32 (token index,
version) pairs, and its routed experts (routing replay: the experts of each sampled token in each
MoE layer, [tokens, layers, top_k]) as packed uint8, or uint16 for a model of over 256 experts;
nothing is pickle.

A group to encode may hold its ids, log-probs and masks as lists, numpy arrays or array.arrays;
a decoded group holds read-only numpy arrays (int32 ids, float32 log-probs, bool masks), views
of the payload made without walking the items in Python (common/tokens.py). Messages compare
equal when their values are, whichever of the two holds them.

A decoder returns a valid message or raises `MessageError` naming what was wrong; the caller
dead-letters the entry with that reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

import msgpack
import numpy as np

from common.images import MAX_IMAGE_BYTES, MAX_IMAGES, check_images
from common.tokens import IDS, LOGPROBS, MASK, Floats, Ints, pack_ids, pack_logprobs, pack_mask, same_values
from common.tokens import MessageError as MessageError  # raised by the decoders; defined beside the packing

SCHEMA = 1
# Defaults of the config's [limits]: a decoder refuses anything beyond them.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a payload larger than this is not unpacked
MAX_COMPLETION_TOKENS = 32_768  # token ids in one completion (and in a prompt)
MAX_GROUP_SIZE = 1_024  # completions in a group; samples a prompt may ask for (n)
# An episode (multi-turn, with an environment) also ends on "turns" (its turn limit) and
# "timeout" (its time limit); see generators/episodes.py.
FINISH_REASONS = ("stop", "length", "abort", "turns", "timeout")


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class PromptTask:
    id: str  # deterministic: "{dataset}:{epoch}:{index}"; the group made from it reuses it
    messages: list[dict[str, str]] | None  # chat messages (role, content); None when `text` is set
    text: str | None  # raw prompt text; None when `messages` is set
    meta: dict[str, Any]  # what the reward reads: ground truth under "answer", meta_columns, and "source"
    n: int  # completions wanted (the group size)
    admitted_at: int  # trainer version when the producer admitted it
    # Name of the [[data.sources]] table it was drawn from, which picks its reward, environment and
    # episode limits; None: the entry names none (written by hand; the run's first reward scores it).
    # On the wire it is meta["source"], where it has always been: entries read the same both ways.
    source: str | None = None
    # A vision-language prompt's images, PNG or JPEG file bytes in order (common/images.py); (): none.
    images: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        named = self.meta.get("source")
        if self.source is None:  # decoded, or built from a meta that names it
            object.__setattr__(self, "source", named if isinstance(named, str) else None)
        elif named is None:  # it travels in meta: keep the two one
            object.__setattr__(self, "meta", {**self.meta, "source": self.source})
        assert named is None or named == self.source or self.source is None, \
            f"prompt {self.id}: source {self.source!r} but meta['source'] = {named!r}"


@dataclass(frozen=True, slots=True)
class Completion:
    ids: Ints  # sampled token ids (eos included when finish == "stop")
    logprobs: Floats  # behaviour log-prob of each sampled id, as the trainer computes it
    reward: float  # scalar reward used for the advantage
    rewards: dict[str, float]  # named reward components (the scalar's parts)
    finish: str  # "stop" (eos; an episode: the environment said done), "length" (max_new_tokens), "abort",
    # and for episodes "turns" (max_turns) and "timeout" (episode_timeout_s)
    text: str  # decoded completion
    loss_mask: Ints | None = None  # 1 where the token is trained on (an episode: the model's); None means all
    reward_error: str | None = None  # why the reward function failed (reward is then 0); None: it ran
    # Where each weight version began, as (token index, version) pairs: the first at index 0, both
    # strictly ascending (a completion that went on under newer weights, generator.inflight_updates).
    # None: every token was sampled with the group's `version`.
    versions: list[tuple[int, int]] | None = None
    # The teacher's log-prob of each sampled id over the same prefix (on-policy distillation,
    # common/teacher.py), 0 where loss_mask is 0 (an environment's tokens are not scored); None:
    # no teacher scored it (none configured, or it failed: the group is then reward-only).
    teacher_logprobs: Floats | None = None
    # Routing replay (generator.routing_replay): the experts that chose each sampled token, in each MoE
    # layer, (len(ids), layers, top_k) ints, in the group's `routing` shape: those of the forward pass
    # whose logits sampled it. None: not recorded (the trainer routes it itself).
    experts: np.ndarray | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Completion):
            return NotImplemented
        return all(same_values(getattr(self, f), getattr(other, f)) for f in self.__slots__)


@dataclass(frozen=True, slots=True)
class SampleGroup:
    id: str  # deterministic from the prompt: a redelivered group is recognised
    prompt_id: str  # PromptTask.id it was made from
    prompt_ids: Ints  # prompt token ids, chat template applied
    version: int  # weight version the tokens were sampled with; the oldest token's when they span versions
    generator: str  # id of the generator that made it
    engine: str  # the engine's name: "hf", "vllm" or "openai" (engines/*: `name`)
    completions: list[Completion]
    timings: dict[str, float] = field(default_factory=dict)  # seconds: "generate", "reward"
    # When the weights of its newest version were published (their WeightVersion.created_at): tells
    # weights the trainer published under that number before it went back from those it published
    # since (common/progress.py:GoneBack). 0: not said (a writer from before, a recording).
    published_at: float = 0.0
    # The teacher whose log-probs its completions carry (TeacherConfig.label); "": none. Where the
    # teacher failed on this group, `teacher_error` says why (and no completion carries log-probs).
    teacher: str = ""
    teacher_error: str = ""
    # The teacher's weights (common/teacher.py `fingerprint`: XXH3 of its safetensors files, 16 hex
    # digits), so that a teacher directory rewritten under the same name is told apart; "": none
    # scored it, or a served teacher (its weights are the server's).
    teacher_version: str = ""
    # Routing replay: (MoE layers, experts per token, routed experts) of the model that sampled it,
    # where every completion carries its `experts`; None: none does.
    routing: tuple[int, int, int] | None = None
    # The prompt's images (PromptTask.images), which the trainer turns into pixel values as the
    # generator's engine did, to compute the same log-probs; (): a text prompt.
    images: tuple[bytes, ...] = ()

    @property
    def newest_version(self) -> int:
        """The newest weight version any of its tokens was sampled with."""
        return max([self.version] + [c.versions[-1][1] for c in self.completions if c.versions])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleGroup):
            return NotImplemented
        return all(same_values(getattr(self, f), getattr(other, f)) for f in self.__slots__)


@dataclass(frozen=True, slots=True)
class WeightVersion:
    version: int  # optimizer steps behind these weights
    step: int  # trainer step that published them
    path: str  # HF-format safetensors checkpoint directory
    format: str  # "safetensors" (full weights) or "lora_adapter" (peft's adapter alone): common/checkpoints.py
    checksums: dict[str, str]  # file name -> "ALGORITHM:HEX" (common/checkpoints.py), for every file in `path`
    created_at: float  # unix seconds; within a run it never goes back, even when the version does
    # The trainer's last go-back (common/progress.py:GoneBack) before this publish: weights a generator
    # loaded that were published before `gone_back_at` under a version above `gone_back_step` are
    # abandoned. 0 and 0.0: it never went back.
    gone_back_step: int = 0
    gone_back_at: float = 0.0
    # The digest of the same weights as broadcast over the trainer's collective (common/transfer.py:
    # Offer.digest); "": not broadcast. A generator that received them loads them instead of the files.
    transfer_digest: str = ""


# --------------------------------------------------------------------------- packing


def _dump(d: dict[str, Any]) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


def _completion_map(c: Completion, what: str, routing: tuple[int, int, int] | None = None) -> dict[str, Any]:
    d = {"ids": pack_ids(c.ids, f"{what}.ids"), "logprobs": pack_logprobs(c.logprobs, f"{what}.logprobs"),
         "reward": c.reward, "rewards": c.rewards, "finish": c.finish, "text": c.text,
         "loss_mask": None if c.loss_mask is None else pack_mask(c.loss_mask, f"{what}.loss_mask")}
    if c.reward_error is not None:
        d["reward_error"] = c.reward_error
    if c.versions is not None:  # (token index, version) pairs, flat
        d["versions"] = pack_ids([x for pair in c.versions for x in pair], f"{what}.versions")
    if c.teacher_logprobs is not None:  # absent without a teacher: older groups read the same
        d["teacher_logprobs"] = pack_logprobs(c.teacher_logprobs, f"{what}.teacher_logprobs")
    if c.experts is not None:  # absent without routing replay
        d["experts"] = pack_experts(c.experts, routing, f"{what}.experts")
    return d


def experts_dtype(experts: int) -> np.dtype:
    """How expert indices travel: uint8 for a model of at most 256 experts, else uint16."""
    return np.dtype(np.uint8) if experts <= 256 else np.dtype("<u2")


def pack_experts(experts: Any, routing: tuple[int, int, int] | None, what: str) -> bytes:
    """A completion's experts ((tokens, layers, top_k) ints) as packed bytes, in `routing`'s shape;
    MessageError where they do not fit it."""
    if routing is None:
        raise MessageError(f"{what}: experts, but the group names no routing (layers, top_k, experts)")
    layers, top_k, count = routing
    a = np.asarray(experts)
    if a.ndim != 3 or a.shape[1:] != (layers, top_k) or a.dtype.kind not in "iu":
        raise MessageError(f"{what}: {a.dtype} of shape {a.shape}, not integers of (tokens, {layers}, {top_k})")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= count):
        raise MessageError(f"{what}: an expert index outside [0, {count})")
    return np.ascontiguousarray(a, dtype=experts_dtype(count)).tobytes()


def encode(msg: PromptTask | SampleGroup | WeightVersion) -> bytes:
    if isinstance(msg, PromptTask):
        return _dump({"v": SCHEMA, "t": "prompt", "id": msg.id, "messages": msg.messages,
                      "text": msg.text, "meta": msg.meta, "n": msg.n,
                      "admitted_at": msg.admitted_at, **({"images": list(msg.images)} if msg.images else {})})
    if isinstance(msg, SampleGroup):
        d = {"v": SCHEMA, "t": "group", "id": msg.id, "prompt_id": msg.prompt_id,
             "prompt_ids": pack_ids(msg.prompt_ids, f"group {msg.id}.prompt_ids"), "version": msg.version,
             "generator": msg.generator, "engine": msg.engine, "timings": msg.timings}
        if msg.published_at:  # unsaid (0) is absent: a recording's bytes stay what they were
            d["published_at"] = msg.published_at
        if msg.teacher:  # no teacher: absent, as published_at
            d["teacher"] = msg.teacher
        if msg.teacher_error:
            d["teacher_error"] = msg.teacher_error
        if msg.teacher_version:
            d["teacher_version"] = msg.teacher_version
        if msg.routing is not None:  # no routing replay: absent
            d["routing"] = list(msg.routing)
        if msg.images:  # a text prompt's group: absent
            d["images"] = list(msg.images)
        d["completions"] = [_completion_map(c, f"group {msg.id}.completions[{i}]", msg.routing)
                            for i, c in enumerate(msg.completions)]
        return _dump(d)
    if isinstance(msg, WeightVersion):
        d = {"v": SCHEMA, "t": "weights", "version": msg.version, "step": msg.step, "path": msg.path,
             "format": msg.format, "checksums": msg.checksums, "created_at": msg.created_at}
        if msg.gone_back_at:  # never went back: absent
            d.update(gone_back_step=msg.gone_back_step, gone_back_at=msg.gone_back_at)
        if msg.transfer_digest:  # not broadcast: absent
            d["transfer_digest"] = msg.transfer_digest
        return _dump(d)
    raise TypeError(f"not a wire message: {type(msg).__name__}")


# --------------------------------------------------------------------------- decoding


def _load(blob: Any, kind: str, max_bytes: int) -> dict[str, Any]:
    if not isinstance(blob, bytes | bytearray):
        raise MessageError(f"payload is {type(blob).__name__}, not bytes")
    if len(blob) > max_bytes:
        raise MessageError(f"payload of {len(blob)} bytes exceeds the limit of {max_bytes}")
    try:
        d = msgpack.unpackb(bytes(blob), raw=False, strict_map_key=True,
                            max_bin_len=max_bytes, max_str_len=max_bytes)
    except Exception as err:  # msgpack raises several unrelated types for malformed input
        raise MessageError(f"not MessagePack: {type(err).__name__}: {err}") from None
    if not isinstance(d, dict):
        raise MessageError(f"payload is a {type(d).__name__}, not a map")
    if d.get("v") != SCHEMA:
        raise MessageError(f"schema version {d.get('v')!r}, expected {SCHEMA}")
    if d.get("t") != kind:
        raise MessageError(f"message type {d.get('t')!r}, expected {kind!r}")
    return d


def _get(d: dict[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    if key not in d:
        raise MessageError(f"{what}: missing field {key!r}")
    value = d[key]
    # bool is an int in Python; never accept it where a number is meant.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise MessageError(f"{what}.{key}: expected {types}, got bool")
    if not isinstance(value, types):
        raise MessageError(f"{what}.{key}: expected {types}, got {type(value).__name__}")
    return value


def _finite(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise MessageError(f"{what}: expected a number, got {type(x).__name__}")
    if not math.isfinite(x):
        raise MessageError(f"{what}: {x} is not finite")
    return float(x)


def _str_map(d: Any, what: str) -> dict[str, Any]:
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise MessageError(f"{what}: expected a map with string keys")
    return d


def _finite_map(d: Any, what: str) -> dict[str, float]:
    return {k: _finite(v, f"{what}.{k}") for k, v in _str_map(d, what).items()}


def decode_prompt(blob: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES, max_n: int = MAX_GROUP_SIZE,
                  max_images: int = MAX_IMAGES, max_image_bytes: int = MAX_IMAGE_BYTES) -> PromptTask:
    d = _load(blob, "prompt", max_bytes)
    w = "prompt"
    pid = _get(d, "id", str, w)
    messages, text = d.get("messages"), d.get("text")
    if (messages is None) == (text is None):
        raise MessageError(f"prompt {pid}: exactly one of 'messages' and 'text' must be set")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise MessageError(f"prompt {pid}: 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise MessageError(f"prompt {pid}: messages[{i}] needs string 'role' and 'content'")
    if text is not None and (not isinstance(text, str) or not text):
        raise MessageError(f"prompt {pid}: 'text' must be a non-empty string")
    n = _get(d, "n", int, w)
    if not 1 <= n <= max_n:
        raise MessageError(f"prompt {pid}: n={n}, expected 1..{max_n}")
    images = check_images(d["images"], f"prompt {pid}", max_images=max_images,
                          max_image_bytes=max_image_bytes) if "images" in d else ()
    return PromptTask(id=pid, messages=messages, text=text, meta=_str_map(d.get("meta", {}), "meta"),
                      n=n, admitted_at=_get(d, "admitted_at", int, w), images=images)  # source: meta["source"]


def _packed(blob: Any, dtype: np.dtype, what: str) -> bytes:
    """A packed array field's bytes, checked to hold a whole number of `dtype` items."""
    if not isinstance(blob, bytes):
        raise MessageError(f"{what}: expected packed bytes, got {type(blob).__name__}")
    if len(blob) % dtype.itemsize:
        raise MessageError(f"{what}: {len(blob)} bytes is not a whole number of {dtype.str} items")
    return blob


def _completion_fields(c: object, cw: str, *, max_tokens: int) -> tuple[bytes, bytes, bytes | None, dict[str, Any]]:
    """One completion of a group's `completions` list (`cw` names it in errors): its packed ids,
    log-probs and loss mask, their sizes checked (their values are checked on the whole group's
    arrays at once), and its other fields, checked."""
    if not isinstance(c, dict):
        raise MessageError(f"{cw}: expected a map")
    ids = _packed(_get(c, "ids", bytes, cw), IDS, f"{cw}.ids")
    lps = _packed(_get(c, "logprobs", bytes, cw), LOGPROBS, f"{cw}.logprobs")
    n = len(ids) // IDS.itemsize
    if n == 0:
        raise MessageError(f"{cw}: empty completion")
    if n > max_tokens:
        raise MessageError(f"{cw}: {n} tokens exceed the limit of {max_tokens}")
    if len(lps) != len(ids):
        raise MessageError(f"{cw}: {n} ids but {len(lps) // LOGPROBS.itemsize} logprobs")
    mask = c.get("loss_mask")
    if mask is not None and len(_packed(mask, MASK, f"{cw}.loss_mask")) != n:
        raise MessageError(f"{cw}: loss_mask must be 0/1 with one entry per id")
    finish = _get(c, "finish", str, cw)
    if finish not in FINISH_REASONS:
        raise MessageError(f"{cw}: finish {finish!r} not one of {FINISH_REASONS}")
    reward_error = c.get("reward_error")
    if reward_error is not None and not isinstance(reward_error, str):
        raise MessageError(f"{cw}.reward_error: expected a string or nothing, got {type(reward_error).__name__}")
    return ids, lps, mask, {"reward": _finite(c.get("reward"), f"{cw}.reward"),
                            "rewards": _finite_map(c.get("rewards", {}), f"{cw}.rewards"), "finish": finish,
                            "text": _get(c, "text", str, cw), "reward_error": reward_error,
                            "versions": _decode_versions(c.get("versions"), cw, tokens=n)}


_NUMBER = (int, float)  # exact types: MessagePack gives no subclasses, and bool is not a number here


def _plain_completion(c: object, max_tokens: int) -> dict[str, Any] | None:
    """The fields of a completion that is plainly valid, tested without building a single error
    text (most groups are; this is the decoder's hot path); None where `_completion_fields` must
    look closer, to accept it after all or to say what is wrong."""
    if type(c) is not dict:
        return None
    ids, lps, mask, reward, rewards = c.get("ids"), c.get("logprobs"), c.get("loss_mask"), c.get("reward"), \
        c.get("rewards", {})
    ok = (type(ids) is bytes and type(lps) is bytes and 0 < len(ids) == len(lps) <= 4 * max_tokens
          and not len(ids) % 4 and (mask is None or (type(mask) is bytes and 4 * len(mask) == len(ids)))
          and c.get("finish") in FINISH_REASONS and type(c.get("text")) is str
          and type(reward) in _NUMBER and math.isfinite(reward) and type(rewards) is dict
          and all(type(k) is str and type(v) in _NUMBER and math.isfinite(v) for k, v in rewards.items())
          and (c.get("reward_error") is None or type(c["reward_error"]) is str)
          and c.get("versions") is None)  # a completion spanning weight versions is read closely
    if not ok:
        return None
    return {"reward": float(reward), "rewards": {k: float(v) for k, v in rewards.items()}, "finish": c["finish"],
            "text": c["text"], "reward_error": c.get("reward_error")}


def _first_bad(arrays: list[np.ndarray | None], bad: Callable[[np.ndarray], bool]) -> int:
    """Index of the first of `arrays` that `bad` flags (one is known to be)."""
    return next(i for i, a in enumerate(arrays) if a is not None and bad(a))


def _completions(raw: list, w: str, *, max_tokens: int) -> tuple[list[Completion], np.ndarray]:
    """A group's completions, their ids, log-probs and masks as read-only views of one array each
    (the log-probs and masks checked on those arrays, not per item in Python), and all their ids."""
    parts = []
    for i, c in enumerate(raw):
        plain = _plain_completion(c, max_tokens)
        parts.append((c["ids"], c["logprobs"], c.get("loss_mask"), plain) if plain is not None
                     else _completion_fields(c, f"{w}.completions[{i}]", max_tokens=max_tokens))
    ends = list(accumulate(len(p[0]) // IDS.itemsize for p in parts))
    spans = list(zip([0, *ends], ends, strict=False))
    ids = np.frombuffer(b"".join(p[0] for p in parts), IDS)
    lps = np.frombuffer(b"".join(p[1] for p in parts), LOGPROBS)
    if not (np.isfinite(lps).all() and lps.max() <= 1e-4):
        i = _first_bad([lps[a:b] for a, b in spans], lambda x: not np.isfinite(x).all() or bool((x > 1e-4).any()))
        raise MessageError(f"{w}.completions[{i}]: logprobs must be finite and <= 0")
    masks = np.frombuffer(b"".join(p[2] for p in parts if p[2] is not None), MASK)
    views: list[np.ndarray | None] = []  # each completion's mask, a view of `masks`
    at = 0
    for (a, b), p in zip(spans, parts, strict=True):
        views.append(None if p[2] is None else masks[at:at + b - a])
        at += 0 if p[2] is None else b - a
    if masks.size and masks.max() > 1:
        i = _first_bad(views, lambda x: bool((x > 1).any()))
        raise MessageError(f"{w}.completions[{i}]: loss_mask must be 0/1 with one entry per id")
    completions = [Completion(ids=ids[a:b], logprobs=lps[a:b], loss_mask=None if m is None else m.view(np.bool_),
                              teacher_logprobs=_teacher_logprobs(c, f"{w}.completions[{i}]", tokens=b - a), **p[3])
                   for i, ((a, b), m, p, c) in enumerate(zip(spans, views, parts, raw, strict=True))]
    return completions, ids


def _teacher_logprobs(c: dict[str, Any], cw: str, *, tokens: int) -> np.ndarray | None:
    """A completion's teacher log-probs (read-only float32, one per id), checked; None where absent."""
    blob = c.get("teacher_logprobs")
    if blob is None:
        return None
    if not isinstance(blob, bytes):
        raise MessageError(f"{cw}.teacher_logprobs: expected packed float32, got {type(blob).__name__}")
    out = np.frombuffer(_packed(blob, LOGPROBS, f"{cw}.teacher_logprobs"), LOGPROBS)
    if out.size != tokens:
        raise MessageError(f"{cw}: {tokens} ids but {out.size} teacher_logprobs")
    if not (np.isfinite(out).all() and (out <= 1e-4).all()):
        raise MessageError(f"{cw}: teacher_logprobs must be finite and <= 0")
    return out


def _decode_versions(blob: Any, cw: str, *, tokens: int) -> list[tuple[int, int]] | None:
    """A completion's `versions` ((token index, version) pairs), checked; None where absent."""
    if blob is None:
        return None
    if not isinstance(blob, bytes):
        raise MessageError(f"{cw}.versions: expected packed int32 pairs, got {type(blob).__name__}")
    flat = np.frombuffer(_packed(blob, IDS, f"{cw}.versions"), IDS)
    if flat.size == 0 or flat.size % 2:
        raise MessageError(f"{cw}.versions: expected (token index, version) pairs, got {flat.size} numbers")
    starts, versions = flat[0::2], flat[1::2]
    if starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= tokens:
        raise MessageError(f"{cw}.versions: token indices must start at 0 and ascend strictly below {tokens}")
    if versions[0] < 0 or (np.diff(versions) <= 0).any():
        raise MessageError(f"{cw}.versions: versions must be >= 0 and ascend strictly")
    return [(int(i), int(v)) for i, v in zip(starts, versions, strict=True)]


def token_versions(completion: Completion, *, group_version: int) -> np.ndarray:
    """The weight version that sampled each of the completion's tokens (int32, one per id)."""
    out = np.full(len(completion.ids), group_version, dtype=np.int32)
    for start, version in completion.versions or ():
        out[start:] = version  # later spans overwrite: each holds from its start to the next
    return out


def peek_id(blob: Any, *, max_bytes: int = MAX_MESSAGE_BYTES) -> str | None:
    """The `id` of a prompt or group message that does not decode as a whole, where its map has
    one (a dead letter can then settle its admitted prompt); None for anything else."""
    try:
        d = msgpack.unpackb(bytes(blob), raw=False, max_bin_len=max_bytes, max_str_len=max_bytes)
    except Exception:  # noqa: BLE001 - garbage of any kind simply has no id
        return None
    gid = d.get("id") if isinstance(d, dict) else None
    return gid if isinstance(gid, str) and gid else None


def decode_group(blob: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES, vocab_size: int | None = None,
                 max_tokens: int = MAX_COMPLETION_TOKENS, max_completions: int = MAX_GROUP_SIZE,
                 max_images: int = MAX_IMAGES, max_image_bytes: int = MAX_IMAGE_BYTES) -> SampleGroup:
    d = _load(blob, "group", max_bytes)
    gid = _get(d, "id", str, "group")
    w = f"group {gid}"
    prompt_ids = np.frombuffer(_packed(_get(d, "prompt_ids", bytes, w), IDS, f"{w}.prompt_ids"), IDS)
    if prompt_ids.size == 0:
        raise MessageError(f"{w}: empty prompt_ids")
    if prompt_ids.size > max_tokens:
        raise MessageError(f"{w}: {prompt_ids.size} prompt tokens exceed the limit of {max_tokens}")
    raw = _get(d, "completions", list, w)
    if not raw:
        raise MessageError(f"{w}: no completions")
    if len(raw) > max_completions:
        raise MessageError(f"{w}: {len(raw)} completions exceed the limit of {max_completions}")
    completions, ids = _completions(raw, w, max_tokens=max_tokens)
    if vocab_size is not None:  # token id range, checked on the arrays
        low, top = min(int(prompt_ids.min()), int(ids.min())), max(int(prompt_ids.max()), int(ids.max()))
        if low < 0 or top >= vocab_size:
            raise MessageError(f"{w}: token id out of range [0, {vocab_size}): saw {low}..{top}")
    version = _get(d, "version", int, w)
    if version < 0:
        raise MessageError(f"{w}: negative version {version}")
    oldest = min([version] + [c.versions[0][1] for c in completions if c.versions is not None])
    if oldest < version:  # a group is as stale as its oldest token: its version may not hide one
        raise MessageError(f"{w}: a token sampled with version {oldest}, older than the group's version {version}")
    timings = _finite_map(d.get("timings", {}), f"{w}.timings")
    published_at = _finite(d.get("published_at", 0.0), f"{w}.published_at")
    if published_at < 0:
        raise MessageError(f"{w}: negative published_at {published_at}")
    teacher = _get(d, "teacher", str, w) if "teacher" in d else ""
    teacher_error = _get(d, "teacher_error", str, w) if "teacher_error" in d else ""
    teacher_version = _get(d, "teacher_version", str, w) if "teacher_version" in d else ""
    routing = _decode_routing(d, raw, completions, w)
    if routing is not None:
        completions = [replace(c, experts=e) for c, e in zip(completions, routing[1], strict=True)]
    return SampleGroup(id=gid, prompt_id=_get(d, "prompt_id", str, w), prompt_ids=prompt_ids,
                       version=version, generator=_get(d, "generator", str, w),
                       engine=_get(d, "engine", str, w), completions=completions, timings=timings,
                       published_at=published_at, teacher=teacher, teacher_error=teacher_error,
                       teacher_version=teacher_version, routing=None if routing is None else routing[0],
                       images=check_images(d["images"], w, max_images=max_images, max_image_bytes=max_image_bytes)
                       if "images" in d else ())


MAX_EXPERTS = 65_536  # what uint16 indices can name
MAX_ROUTED = 4_096  # MoE layers x experts per token of one token's routing


def _decode_routing(d: dict[str, Any], raw: list, completions: list[Completion], w: str
                    ) -> tuple[tuple[int, int, int], list[np.ndarray]] | None:
    """A group's routing (layers, top_k, experts) and each completion's experts (read-only
    (tokens, layers, top_k) arrays), checked: one row per id, every index below the group's
    experts, no expert twice in one token's row; None where the group carries none."""
    if "routing" not in d:
        if any(isinstance(c, dict) and c.get("experts") is not None for c in raw):
            raise MessageError(f"{w}: completions carry experts but the group names no routing")
        return None
    shape = d["routing"]
    if not (isinstance(shape, list) and len(shape) == 3 and all(type(x) is int for x in shape)):
        raise MessageError(f"{w}.routing: expected [layers, top_k, experts] integers, got {shape!r}")
    layers, top_k, count = shape
    if not (layers >= 1 and 1 <= top_k <= count <= MAX_EXPERTS and layers * top_k <= MAX_ROUTED):
        raise MessageError(f"{w}.routing: layers {layers}, top_k {top_k}, experts {count}: need layers >= 1, "
                           f"1 <= top_k <= experts <= {MAX_EXPERTS}, layers x top_k <= {MAX_ROUTED}")
    dtype = experts_dtype(count)
    out = []
    for i, (c, done) in enumerate(zip(raw, completions, strict=True)):
        cw = f"{w}.completions[{i}].experts"
        blob = c.get("experts")
        if not isinstance(blob, bytes):
            raise MessageError(f"{cw}: expected packed {dtype.str} expert indices, got {type(blob).__name__}")
        n = len(done.ids)
        if len(blob) != n * layers * top_k * dtype.itemsize:
            raise MessageError(f"{cw}: {len(blob)} bytes, expected {n} tokens x {layers} layers x {top_k} experts "
                               f"of {dtype.str}")
        a = np.frombuffer(blob, dtype).reshape(n, layers, top_k)
        if a.size and int(a.max()) >= count:
            raise MessageError(f"{cw}: expert index {int(a.max())} out of range [0, {count})")
        if top_k > 1 and (np.diff(np.sort(a, axis=-1), axis=-1) == 0).any():
            raise MessageError(f"{cw}: an expert twice among one token's {top_k}")
        out.append(a)
    return (layers, top_k, count), out


def decode_weights(blob: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> WeightVersion:
    d = _load(blob, "weights", max_bytes)
    w = "weights"
    checksums = _str_map(_get(d, "checksums", dict, w), f"{w}.checksums")
    if not checksums or not all(isinstance(v, str) for v in checksums.values()):
        raise MessageError(f"{w}: checksums must map file names to checksum strings")
    return WeightVersion(version=_get(d, "version", int, w), step=_get(d, "step", int, w),
                         path=_get(d, "path", str, w), format=_get(d, "format", str, w),
                         checksums=checksums, created_at=_finite(d.get("created_at"), f"{w}.created_at"),
                         gone_back_step=_get(d, "gone_back_step", int, w) if "gone_back_step" in d else 0,
                         gone_back_at=_finite(d.get("gone_back_at", 0.0), f"{w}.gone_back_at"),
                         transfer_digest=_get(d, "transfer_digest", str, w) if "transfer_digest" in d else "")
