"""model.path as a hub id: resolved through a Hugging Face cache with the network off."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, model_dir: Path) -> Path:
    """A Hugging Face hub cache holding `model_dir`'s files as REPO's snapshot, laid out as
    huggingface_hub lays it out (models--owner--name/{refs/main, snapshots/<commit>/...})."""
    repo = root / "hub" / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    return root / "hub"


def offline_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLOUTS_", "HF_"))}
    # No hub: an endpoint that refuses connections stands for a machine without network.
    env.update(PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9",
               ROLLOUTS_MODEL__PATH=REPO, **extra)
    return env


RESOLVE = """
import sys
from common.config import load_config
from common.models import ModelError, resolve_model_path
try:
    path = resolve_model_path(load_config().model.path)
except ModelError as err:
    sys.exit(f"trainer: {err}")
if sys.argv[1:] == ["load"]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoTokenizer.from_pretrained(path); AutoModelForCausalLM.from_pretrained(path)
print(path)
"""


def resolve(tmp_path: Path, *args: str, **flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RESOLVE, *args], env=offline_env(tmp_path, **flags), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_a_hub_id_resolves_from_the_cache_with_the_network_off(tmp_path, tiny_model):
    cache = fake_hub_cache(tmp_path / "hf", tiny_model)
    # offline mode (and the model loads from there), or simply no hub reachable
    for proc in (resolve(tmp_path, "load", HF_HUB_OFFLINE="1"), resolve(tmp_path)):
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == str(cache / f"models--HuggingFaceTB--SmolLM2-135M-Instruct"
                                                                    f"/snapshots/{COMMIT}")


def test_an_uncached_hub_id_gives_one_clear_line(tmp_path):
    (tmp_path / "hf" / "hub").mkdir(parents=True)
    trainer = subprocess.run([sys.executable, "-m", "trainer"], env=offline_env(tmp_path, HF_HUB_OFFLINE="1"),
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert trainer.returncode == 2, trainer.stderr
    for proc, why in ((trainer, "HF_HUB_OFFLINE is set"), (resolve(tmp_path), "could not be reached")):
        assert proc.returncode != 0, proc.stdout
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert REPO in lines[0] and "not in the Hugging Face cache" in lines[0] and why in lines[0], lines[0]


LOAD_DATA = """
import sys
from common.config import source_config
from producers.data import DataError, load
try:
    load(source_config(name="gsm8k", path="openai/gsm8k", subset="main", prompt_column="question"),
         field="data.sources[0]")
except DataError as err:
    sys.exit(str(err))
"""


def test_an_uncached_hub_data_set_gives_one_clear_line(tmp_path):
    proc = subprocess.run([sys.executable, "-c", LOAD_DATA], env=offline_env(tmp_path, HF_HUB_OFFLINE="1"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "'openai/gsm8k' is not in the datasets cache" in lines[0] and "HF_HUB_OFFLINE is set" in lines[0], lines[0]


def test_a_generator_without_its_model_exits_2_with_one_line_as_the_trainer_does(tmp_path, redis_url):
    missing = tmp_path / "no-model"
    env = {**offline_env(tmp_path, ROLLOUTS_REDIS_URL=redis_url, ROLLOUTS_GENERATOR__ENGINE="hf"),
           "ROLLOUTS_MODEL__PATH": str(missing)}
    generator = subprocess.run([sys.executable, "-m", "generators", "--id", "g1"], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=300)
    assert generator.returncode == 2, generator.stderr[-3000:]
    assert "Traceback" not in generator.stderr, generator.stderr[-3000:]
    assert f"model.path: no HF checkpoint (config.json) in {missing}" in generator.stderr.strip().splitlines()[-1]
