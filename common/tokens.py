"""Token arrays: the ids, log-probs and loss masks of wire messages, packed and unpacked without
walking their items in Python.

On the wire (common/messages.py) token ids are packed little-endian int32, log-probs
little-endian float32 and loss masks uint8 (0/1). A message built to be sent may hold them as
Python lists, numpy arrays or `array.array`s ('i'/'l'/'q'... for ids, 'f'/'d' for log-probs,
'B'/'b' for masks): an array already of the wire's dtype is handed to MessagePack as its own
buffer, any other is converted by numpy in one call, and a list is converted once by numpy.
A value that the wire's dtype cannot hold is refused with `MessageError`, never truncated: ids
that are not integers or do not fit int32, log-probs that are not numbers, a mask that is not 0/1.

A decoded message holds read-only numpy arrays: int32 ids, float32 log-probs and a bool mask
(bool, so that `sum()` over it counts, where uint8 items would wrap past 255). They compare equal
to lists of the same values through `same_values`, which the message types' `__eq__` use.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

IDS = np.dtype("<i4")  # token ids on the wire
LOGPROBS = np.dtype("<f4")  # log-probs on the wire
MASK = np.dtype("u1")  # loss masks on the wire (0/1)

# What a message may hold for a token sequence: a list, a numpy array or an array.array.
Ints = Sequence[int] | np.ndarray | array.array
Floats = Sequence[float] | np.ndarray | array.array

_INT32 = np.iinfo(np.int32)
# Lists are packed through array.array where its C types are the wire's sizes (everywhere in practice).
_LISTS = array.array("i").itemsize == 4 and array.array("f").itemsize == 4
_SWAP = sys.byteorder == "big"  # the wire is little-endian


class MessageError(ValueError):
    """An entry that is not a valid message of the expected type; the text says why."""


def _from_list(x: list | tuple, typecode: str, what: str, wanted: str) -> memoryview:
    """A list's items packed by `array.array`, which converts them in C and refuses, rather than
    truncates, an item its type cannot hold."""
    try:
        a = array.array(typecode, x)
    except (TypeError, OverflowError, ValueError) as err:
        raise MessageError(f"{what}: {wanted} ({err})") from None
    if _SWAP:
        a.byteswap()
    return memoryview(a).cast("B")


def _flat(x: Any, what: str) -> np.ndarray:
    """`x` as a 1-d numpy array (a view where `x` is an array already)."""
    try:
        a = np.asarray(x)
    except (ValueError, TypeError) as err:  # ragged nesting and the like
        raise MessageError(f"{what}: not a flat sequence of numbers ({err})") from None
    if a.ndim != 1:
        raise MessageError(f"{what}: expected a flat sequence, got shape {a.shape}")
    return a


def _buffer(a: np.ndarray) -> memoryview:
    """The array's bytes as MessagePack packs them (a bin), copied only when not contiguous."""
    return np.ascontiguousarray(a).data.cast("B")


def pack_ids(x: Ints, what: str) -> memoryview:
    """Token ids packed as little-endian int32; MessageError if any is not an integer or does not fit."""
    if _LISTS and isinstance(x, list | tuple):
        return _from_list(x, "i", what, "token ids must be integers that fit int32")
    a = _flat(x, what)
    if a.size == 0:
        return memoryview(b"")
    if a.dtype != IDS:
        if a.dtype.kind not in "iu":
            raise MessageError(f"{what}: token ids must be integers, got {a.dtype}")
        low, top = int(a.min()), int(a.max())
        if low < _INT32.min or top > _INT32.max:
            raise MessageError(f"{what}: token ids must fit int32, saw {low}..{top}")
        a = a.astype(IDS)
    return _buffer(a)


def pack_logprobs(x: Floats, what: str) -> memoryview:
    """Log-probs packed as little-endian float32; MessageError if any is not a number. (Whether
    each is finite and <= 0 is the decoder's check: it names the completion.)"""
    if _LISTS and isinstance(x, list | tuple):
        return _from_list(x, "f", what, "log-probs must be numbers")
    a = _flat(x, what)
    if a.size == 0:
        return memoryview(b"")
    if a.dtype != LOGPROBS:
        if a.dtype.kind not in "fiu":
            raise MessageError(f"{what}: log-probs must be numbers, got {a.dtype}")
        a = a.astype(LOGPROBS)
    return _buffer(a)


def pack_mask(x: Ints, what: str) -> memoryview:
    """A loss mask packed as uint8; MessageError unless every item is 0 or 1 (or a bool)."""
    a = _flat(x, what)
    if a.size == 0:
        return memoryview(b"")
    if a.dtype.kind not in "biu":
        raise MessageError(f"{what}: a loss mask must be 0/1 integers or bools, got {a.dtype}")
    if a.dtype != MASK and a.dtype.kind != "b" and (a.min() < 0 or a.max() > 1):
        raise MessageError(f"{what}: a loss mask must be 0/1, saw {int(a.min())}..{int(a.max())}")
    return _buffer(a.astype(MASK, copy=False))


def same_values(a: Any, b: Any) -> bool:
    """Equality that treats a list and an array of the same values as equal (the message types'
    token fields); plain `==` for anything else."""
    arrays = (np.ndarray, array.array)
    if isinstance(a, arrays) or isinstance(b, arrays):
        if a is None or b is None:
            return False
        x, y = np.asarray(a), np.asarray(b)
        return x.shape == y.shape and bool(np.array_equal(x, y))
    return bool(a == b)
