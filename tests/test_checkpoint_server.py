"""The checkpoint server: only published versions' listed files, read-only; fetched files are
checked against their published checksum on arrival."""

import shutil
import threading
import urllib.error
import urllib.request

import pytest

from common.checkpoint_server import CheckpointServer, fetch_checkpoint
from common.checkpoints import CheckpointError, checksum_dir
from common.keys import PAYLOAD, Keys
from common.messages import WeightVersion, encode

KEYS = Keys("cs")


def announce(r, wv: WeightVersion) -> None:
    r.xadd(KEYS.weights, {PAYLOAD: encode(wv)})


@pytest.fixture
def server(r):
    srv = CheckpointServer(("127.0.0.1", 0), r=r, keys=KEYS, verbose=False)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def status_of(url: str, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_published_version_is_fetched_and_verified(tmp_path, r, server, tiny_model):
    ckpt = tmp_path / "checkpoints" / "step_3"
    shutil.copytree(tiny_model, ckpt)
    (ckpt / "secret.txt").write_text("not published")
    sums = checksum_dir(ckpt)
    del sums["secret.txt"]
    wv = WeightVersion(version=3, step=3, path=str(ckpt), format="safetensors", checksums=sums, created_at=0.0)
    announce(r, wv)

    got = fetch_checkpoint(server, wv, dest_root=tmp_path / "fetched")
    assert got == tmp_path / "fetched" / "step_3" and checksum_dir(got) == sums  # every published file, intact
    # only published versions, only their listed files, only reading
    assert status_of(f"{server}/v3/config.json") == 200
    assert status_of(f"{server}/v3/secret.txt") == 404
    assert status_of(f"{server}/v3/..%2f..%2fetc%2fpasswd") == 404
    assert status_of(f"{server}/v4/config.json") == 404
    assert status_of(f"{server}/") == 404
    assert status_of(f"{server}/v3/config.json", method="PUT") == 501
    assert status_of(f"{server}/v3/config.json", method="DELETE") == 501


def test_a_file_that_does_not_match_its_checksum_refuses_the_version(tmp_path, r, server, tiny_model):
    ckpt = tmp_path / "checkpoints" / "step_5"
    shutil.copytree(tiny_model, ckpt)
    sums = checksum_dir(ckpt)
    wv = WeightVersion(version=5, step=5, path=str(ckpt), format="safetensors", checksums=sums, created_at=0.0)
    announce(r, wv)
    [weights] = ckpt.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # changed on the trainer's disk after publishing
    with pytest.raises(CheckpointError, match=r"has checksum .*, published"):
        fetch_checkpoint(server, wv, dest_root=tmp_path / "fetched")
    assert list((tmp_path / "fetched").iterdir()) == []  # nothing half-fetched is left to load
    unpublished = WeightVersion(version=6, step=6, path=str(ckpt), format="safetensors", checksums=sums,
                                created_at=0.0)
    with pytest.raises(CheckpointError, match="cannot fetch"):
        fetch_checkpoint(server, unpublished, dest_root=tmp_path / "fetched")
