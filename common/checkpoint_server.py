"""Published checkpoints over HTTP, for generators that share no disk with the trainer.

`rollouts serve-checkpoints --bind HOST:PORT` runs beside the trainer (it reads the trainer's
`output_dir`): GET /v{version}/{file} answers with one file of a published version, and nothing
else. A version is served only while the run's weights stream announces it, a file only if its
WeightVersion lists it (with its checksum), and only GET and HEAD are answered: no listing, no
path from the request reaches the file system. A generator with `generator.weights_url` fetches
each new version into `output_dir/fetched/step_N` (temporary name, then rename), checking every
file against the checksum in the WeightVersion as it arrives; a file that does not match refuses the
version, as a bad checkpoint on a shared disk would.
"""

from __future__ import annotations

import shutil
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import redis

from common.checkpoints import (
    CheckpointError,
    algorithm_of,
    checksum_text,
    hasher,
    prune_steps,
    same_checksum,
    verify_dir,
)
from common.keys import PAYLOAD, Keys
from common.messages import MessageError, WeightVersion, decode_weights


def published(r: redis.Redis, keys: Keys, version: int) -> WeightVersion | None:
    """The WeightVersion the run announced last for `version` (a trainer restarted from an older
    state announces its numbers again, with other weights), or None."""
    for _, fields in r.xrevrange(keys.weights):
        try:
            wv = decode_weights(fields[PAYLOAD])
        except MessageError:
            continue
        if wv.version == version:
            return wv
    return None


class _Handler(BaseHTTPRequestHandler):
    server: CheckpointServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) != 2 or not parts[0].startswith("v") or not parts[0][1:].isdigit():
            return self.send_error(404, "ask for /v{version}/{file}")
        version, name = int(parts[0][1:]), urllib.parse.unquote(parts[1])
        wv = published(self.server.r, self.server.keys, version)
        if wv is None or name not in wv.checksums:
            return self.send_error(404, f"version {version} has no published file {name!r}")
        f = Path(wv.path) / name
        if not f.is_file():
            return self.send_error(410, f"version {version} was pruned")
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(f.stat().st_size))
        self.send_header("X-Checksum", wv.checksums[name])
        self.end_headers()
        if body:
            with open(f, "rb") as src:
                shutil.copyfileobj(src, self.wfile, 1 << 20)

    def log_message(self, format: str, *args: object) -> None:  # one line per file served, not per header
        if self.server.verbose:
            super().log_message(format, *args)


class CheckpointServer(ThreadingHTTPServer):
    """The HTTP server and what its handlers read: the run's Redis and keys."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], *, r: redis.Redis, keys: Keys, verbose: bool = True) -> None:
        super().__init__(address, _Handler)
        self.r, self.keys, self.verbose = r, keys, verbose


def fetch_checkpoint(base_url: str, wv: WeightVersion, *, dest_root: Path, keep: int = 2,
                     timeout_s: float = 60.0) -> Path:
    """Download version `wv` from the checkpoint server at `base_url` into `dest_root/step_N`,
    each file checked against its published checksum on arrival; the newest `keep` are kept (none
    past `wv`: fetched before a trainer restarted from an older state). One fetched before is used
    again if it still matches the checksums. CheckpointError when the server cannot give it or a
    file does not match."""
    final = dest_root / f"step_{wv.version}"
    if final.is_dir():
        try:
            verify_dir(final, wv.checksums)
            return final
        except CheckpointError:  # that version's number, fetched before with other weights (a
            shutil.rmtree(final, ignore_errors=True)  # trainer restarted from an older state)
    tmp = dest_root / f".step_{wv.version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, want in sorted(wv.checksums.items()):
            if "/" in name or name in ("", ".", ".."):
                raise CheckpointError(f"version {wv.version}: file name {name!r} is not a plain name")
            url = f"{base_url.rstrip('/')}/v{wv.version}/{urllib.parse.quote(name)}"
            algorithm = algorithm_of(want)
            h = hasher(algorithm)
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as src, open(tmp / name, "wb") as out:
                    while chunk := src.read(1 << 20):
                        h.update(chunk)
                        out.write(chunk)
            except (urllib.error.URLError, OSError) as err:
                raise CheckpointError(f"version {wv.version}: cannot fetch {url}: {err}") from None
            got = checksum_text(h, algorithm)
            if not same_checksum(got, want):
                raise CheckpointError(f"version {wv.version}: {name} from {url} has checksum {got[:21]}…, "
                                      f"published {want[:21]}…")
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_steps(dest_root, keep=keep, newest=wv.version)
    return final
