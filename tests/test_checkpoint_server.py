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


def test_a_version_announced_again_with_other_weights_is_fetched_again(tmp_path, r, server, tiny_model):
    """A trainer restarted from an older state rewrites step_4 and announces version 4 again: a
    generator that fetched the first version 4 gets the new files, not its copy of the old ones,
    and its copies of the versions the trainer went back on are removed."""
    from tests.harness.models import trained
    from trainer.checkpoints import write_checkpoint

    def publish(step: int, seed: int) -> WeightVersion:
        path, sums = write_checkpoint(trained(tiny_model, seed=seed), checkpoint_dir=tmp_path / "checkpoints",
                                      step=step, source_dir=tiny_model)
        wv = WeightVersion(version=step, step=step, path=str(path), format="safetensors", checksums=sums,
                           created_at=float(seed))
        announce(r, wv)
        return wv

    dest = tmp_path / "fetched"
    first = publish(4, seed=1)
    assert checksum_dir(fetch_checkpoint(server, first, dest_root=dest)) == first.checksums
    ahead = publish(5, seed=2)
    fetch_checkpoint(server, ahead, dest_root=dest)
    again = publish(4, seed=3)  # the restart: step 4 written and announced again
    assert again.checksums != first.checksums
    got = fetch_checkpoint(server, again, dest_root=dest)
    assert checksum_dir(got) == again.checksums
    assert sorted(p.name for p in dest.iterdir()) == ["step_4"]  # version 5 belonged to the run gone back on
    with urllib.request.urlopen(f"{server}/v4/model.safetensors", timeout=10) as resp:
        assert resp.headers["X-Checksum"] == again.checksums["model.safetensors"]
