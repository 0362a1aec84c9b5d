"""Published checkpoints: HF-format safetensors directories with per-file checksums.

A checksum is `"ALGORITHM:HEX"`. Publishers write `xxh3_128` (XXH3, 128 bits: about 25 GB/s on
one core here against sha256's 1.9, so hashing the default model's 538 MB costs 0.02 s a side
instead of 0.29; it guards against torn, truncated and mixed-up files, not against forgery, as
sha256 did not either, since whoever can write the checkpoint can announce its checksum).
`sha256:HEX` and a bare 64-digit sha256 hex (what earlier versions published and recorded) are
verified as before.

`write_safetensors` writes a safetensors file and returns its checksum, hashed from the bytes as
they are written (in a thread beside the writes), so a publisher never reads its file back.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    import torch

CHUNK = 16 << 20  # bytes per write (and per hash update)
WEIGHTS_FILE = "model.safetensors"  # the one weights file a published checkpoint has
# A published LoRA adapter (trainer.lora.publish = "adapter"): peft's two files, nothing else.
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# WeightVersion.format: full HF weights, or a LoRA adapter of the run's base model.
FULL_FORMAT = "safetensors"
ADAPTER_FORMAT = "lora_adapter"


def is_adapter_dir(path: str | Path) -> bool:
    """Whether the checkpoint directory `path` holds a LoRA adapter (peft's format) rather than full weights."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _adapter_field(path: str | Path, field: str, kind: type) -> Any:
    try:
        value = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get(field)
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"adapter {path}: {ADAPTER_CONFIG} could not be read: {err}") from None
    if not isinstance(value, kind) or not value:
        raise CheckpointError(f"adapter {path}: {ADAPTER_CONFIG} has no {field}")
    return value


def adapter_base(path: str | Path) -> str:
    """The base model the LoRA adapter in the directory `path` was trained on (its
    adapter_config.json's base_model_name_or_path); CheckpointError if it names none."""
    return _adapter_field(path, "base_model_name_or_path", str)


def adapter_rank(path: str | Path) -> int:
    """The rank (`r`) of the LoRA adapter in the directory `path`; CheckpointError if it has none."""
    return _adapter_field(path, "r", int)


class CheckpointError(ValueError):
    """A checkpoint directory does not match the checksums published with it."""


ALGORITHM = "xxh3_128"  # what checksums are made with
_ALGORITHMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_BARE_SHA256 = re.compile(r"[0-9a-f]{64}")


def algorithm_of(checksum: str) -> str:
    """The algorithm a published checksum was made with; CheckpointError for one not known."""
    if _BARE_SHA256.fullmatch(checksum):
        return "sha256"
    algorithm, sep, digest = checksum.partition(":")
    if not sep or algorithm not in _ALGORITHMS or not re.fullmatch(r"[0-9a-f]+", digest):
        raise CheckpointError(f"checksum {checksum[:40]!r} is not ALGORITHM:HEX with an algorithm of "
                              f"{sorted(_ALGORITHMS)} (nor a bare sha256 hex)")
    return algorithm


def hasher(algorithm: str = ALGORITHM) -> Any:
    """A fresh hash object (`update`, `hexdigest`) of `algorithm`."""
    return _ALGORITHMS[algorithm]()


def checksum_text(h: Any, algorithm: str = ALGORITHM) -> str:
    """The checksum of what `h` (from `hasher(algorithm)`) was fed, as published: ALGORITHM:HEX."""
    return f"{algorithm}:{h.hexdigest()}"


def same_checksum(got: str, want: str) -> bool:
    """Whether two checksums of the same algorithm agree (a bare sha256 hex is `sha256:HEX`)."""
    def full(c: str) -> str:
        return f"sha256:{c}" if _BARE_SHA256.fullmatch(c) else c
    return full(got) == full(want)


def file_checksum(path: Path, algorithm: str = ALGORITHM) -> str:
    h = hasher(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return checksum_text(h, algorithm)


def checksum_dir(path: str | Path, *, known: Mapping[str, str] | None = None) -> dict[str, str]:
    """The checksum of every regular file directly in `path`, by file name; those named in `known`
    (hashed as they were written) are taken from it instead of being read back."""
    known = known or {}
    return {p.name: known[p.name] if p.name in known else file_checksum(p)
            for p in sorted(Path(path).iterdir()) if p.is_file()}


def _dtype_codes() -> dict[torch.dtype, str]:
    import torch

    return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def write_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor], *,
                      metadata: Mapping[str, str] | None = None, timing: dict[str, float] | None = None) -> str:
    """Write `tensors` (CPU, no two sharing memory) to `path` in the safetensors format, in name
    order; the file's checksum, computed from the bytes as they are written.

    The hash runs in a thread beside the writes (the hashes and file writes release the GIL
    on large buffers), so writing and hashing take about as long as the slower of the two.
    `timing`, if given, gets "write" (seconds in all) and "checksum" (of them, seconds spent
    waiting for the hash once the bytes were written)."""
    t0 = time.perf_counter()
    waited = 0.0
    codes = _dtype_codes()
    names = sorted(tensors)
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in codes:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code")
        if t.device.type != "cpu":
            raise ValueError(f"{name}: on {t.device}, not the CPU")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hasher()
    with open(path, "wb") as f, concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checksum") as hashing:
        pending: list[concurrent.futures.Future] = []
        for chunk in _chunks([struct.pack("<Q", len(head)) + head], names, tensors):
            pending.append(hashing.submit(digest.update, chunk))  # one thread: updates in order
            f.write(chunk)
            if len(pending) > 4:  # chunks hashed may trail the writes by a few, no more
                t = time.perf_counter()
                pending.pop(0).result()
                waited += time.perf_counter() - t
        t = time.perf_counter()
        for fut in pending:
            fut.result()
        waited += time.perf_counter() - t
    if timing is not None:
        timing.update(write=time.perf_counter() - t0, checksum=waited)
    return checksum_text(digest)


def _chunks(first: list[bytes], names: list[str], tensors: Mapping[str, torch.Tensor]):
    """The file's bytes as memoryviews of at most CHUNK bytes, straight from the tensors' memory."""
    import torch

    yield from first
    for name in names:
        t = tensors[name].detach().contiguous()
        if t.numel() == 0:
            continue
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(data), CHUNK):
            yield data[start:start + CHUNK]


def verify_dir(path: str | Path, checksums: dict[str, str]) -> None:
    """Raise CheckpointError unless every listed file exists with its published checksum."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root} does not exist")
    for name, want in checksums.items():
        if "/" in name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {root}: file name {name!r} is not a plain name")
        f = root / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {root}: {name} is missing")
        try:
            got = file_checksum(f, algorithm_of(want))
        except OSError as err:  # removed or replaced while being read: a trainer restarted from an
            # older state rewrites the step directories it had published
            raise CheckpointError(f"checkpoint {root}: {name} could not be read ({err.strerror or err}): "
                                  "removed or replaced while it was checked") from None
        if not same_checksum(got, want):
            raise CheckpointError(f"checkpoint {root}: {name} has checksum {got[:21]}…, published {want[:21]}…")
    if not any(n.endswith(".safetensors") for n in checksums):
        raise CheckpointError(f"checkpoint {root}: no .safetensors file among {sorted(checksums)}")


def pin_checkpoint(path: str | Path, checksums: dict[str, str], pin: Path) -> Path | None:
    """Hard links to checkpoint `path`'s listed files in the new directory `pin`: the trainer may
    prune `path` while a generator that verified it still waits to load it, and the links keep the
    files. Verify the pin, not `path`: a file replaced before it was linked fails its checksum.
    None where links cannot be made (`pin` on another file system): `path` is loaded as it is;
    CheckpointError if a file is gone already. Whoever pins removes the pin once done with it."""
    pin.mkdir(parents=True)
    for file in checksums:
        if "/" in file or file in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {path}: file name {file!r} is not a plain name")
        try:
            os.link(Path(path) / file, pin / file)
        except FileNotFoundError:
            shutil.rmtree(pin, ignore_errors=True)
            raise CheckpointError(f"checkpoint {path}: {file} is missing (pruned before it was loaded?)") from None
        except OSError:  # another file system, or one without hard links
            shutil.rmtree(pin, ignore_errors=True)
            return None
    return pin


def prune_steps(root: Path, *, keep: int, newest: int | None = None, spare: Path | None = None) -> None:
    """Delete all but the newest `keep` step_N directories in `root`; with `newest`, all but the
    newest `keep` up to that step and every one past it. Those past it were written before the
    trainer restarted from an older state (Redis does not know of them; the trainer writes those
    steps again): kept, they would outnumber the ones written since, which would be deleted as
    they were written. `spare` (the model the run started from, which may be one of them) stays."""
    spared = spare.resolve() if spare is not None else None
    dirs = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit() and p.resolve() != spared),
                  key=lambda p: int(p.name[5:]))
    past = [p for p in dirs if newest is not None and int(p.name[5:]) > newest]
    upto = dirs[:len(dirs) - len(past)]
    for old in past + upto[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of every .safetensors file in the directory `path`, read from the
    files' headers only (no tensor data is loaded)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {path}: no .safetensors files")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(st.get_slice(name).get_shape())
        except Exception as err:  # safetensors raises its own error types for a broken header
            raise CheckpointError(f"checkpoint {path}: {f.name} is not a readable safetensors file: {err}") from None
    return shapes


def _tensors_in(path: str | Path) -> Iterator[tuple[str, torch.dtype, list[int], Callable[[memoryview], None]]]:
    """Each tensor of the .safetensors files in the directory `path`, in file order: its name,
    dtype, shape and a function that reads its bytes into a memoryview of exactly its size (to be
    called before the next tensor is asked for: its file is open until then)."""
    dtypes = {code: dtype for dtype, code in _dtype_codes().items()}
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
            header.pop("__metadata__", None)
            base = 8 + size
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                def read(view: memoryview, fh=fh, at=base + info["data_offsets"][0], name=name, f=f) -> None:
                    fh.seek(at)
                    while len(view):
                        got = fh.readinto(view)
                        if not got:
                            raise CheckpointError(f"checkpoint {path}: {f.name} ends inside tensor {name}")
                        view = view[got:]

                yield name, dtypes[info["dtype"]], info["shape"], read


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, writable."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def copy_into(path: str | Path, targets: Mapping[str, torch.Tensor]) -> set[str]:
    """Copy every tensor of the .safetensors files in the directory `path` into the tensor of
    the same name in `targets`, in place (a model's state_dict() shares its parameters' memory);
    the names copied. A CPU tensor of the file's dtype is read straight into (no second copy of
    the weights); others through a buffer, converting dtype. The caller has checked that the
    files fit (`check_fits`): a name absent from `targets` is an error."""
    import torch

    done: set[str] = set()
    for name, dtype, shape, read in _tensors_in(path):
        target = targets[name]
        direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        into = target if direct else torch.empty(shape, dtype=dtype)
        read(_bytes_of(into))
        if not direct:
            target.copy_(into)
        done.add(name)
    return done


def read_tensors(path: str | Path, reuse: Mapping[str, torch.Tensor], *, pin: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the .safetensors files in the directory `path`, read into host memory as
    stored (dtype and shape): into `reuse`'s tensor of the same name where it has that dtype and
    shape, else into a new one, in page-locked memory with `pin` (for copies to a GPU that need no
    staging). What an engine reads beside its sampling to load a version in one copy
    (engines/hf_engine.py `stage`)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, read in _tensors_in(path):
        held = reuse.get(name)
        if held is None or held.dtype != dtype or list(held.shape) != list(shape):
            held = torch.empty(shape, dtype=dtype, pin_memory=pin)
        read(_bytes_of(held))
        out[name] = held
    return out


def check_fits(path: str | Path, reference: dict[str, tuple[int, ...]], *, tied: set[str]) -> None:
    """Raise CheckpointError unless the checkpoint at `path` has exactly the tensors of
    `reference` ({name: shape}), with the same shapes; names in `tied` (an lm_head that shares the
    embedding, which save_pretrained leaves out) may be absent."""
    shapes_fit(tensor_shapes(path), reference, tied=tied, what=f"checkpoint {path}")


def shapes_fit(shapes: dict[str, tuple[int, ...]], reference: dict[str, tuple[int, ...]], *, tied: set[str],
               what: str) -> None:
    """check_fits for tensors named `what` whose {name: shape} is `shapes`."""
    missing = sorted(set(reference) - set(shapes) - tied)
    unexpected = sorted(set(shapes) - set(reference))
    wrong = [k for k in shapes if k in reference and shapes[k] != reference[k]]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{what} does not fit the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}, wrong shapes {wrong[:3]}")
