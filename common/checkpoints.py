"""Published checkpoints: HF-format safetensors directories with per-file sha256 checksums."""

from __future__ import annotations

import hashlib
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint directory does not match the checksums published with it."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checksum_dir(path: str | Path) -> dict[str, str]:
    """sha256 of every regular file directly in `path`, by file name."""
    return {p.name: sha256_file(p) for p in sorted(Path(path).iterdir()) if p.is_file()}


def verify_dir(path: str | Path, checksums: dict[str, str]) -> None:
    """Raise CheckpointError unless every listed file exists with its published sha256."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root} does not exist")
    for name, want in checksums.items():
        if "/" in name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {root}: file name {name!r} is not a plain name")
        f = root / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {root}: {name} is missing")
        got = sha256_file(f)
        if got != want:
            raise CheckpointError(f"checkpoint {root}: {name} has sha256 {got[:12]}…, published {want[:12]}…")
    if not any(n.endswith(".safetensors") for n in checksums):
        raise CheckpointError(f"checkpoint {root}: no .safetensors file among {sorted(checksums)}")


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


def check_fits(path: str | Path, reference: dict[str, tuple[int, ...]], *, tied: set[str]) -> None:
    """Raise CheckpointError unless the checkpoint at `path` has exactly the tensors of
    `reference` ({name: shape}), with the same shapes; names in `tied` (an lm_head that shares the
    embedding, which save_pretrained leaves out) may be absent."""
    shapes = tensor_shapes(path)
    missing = sorted(set(reference) - set(shapes) - tied)
    unexpected = sorted(set(shapes) - set(reference))
    wrong = [k for k in shapes if k in reference and shapes[k] != reference[k]]
    if missing or unexpected or wrong:
        raise CheckpointError(f"checkpoint {path} does not fit the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}, wrong shapes {wrong[:3]}")
