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
