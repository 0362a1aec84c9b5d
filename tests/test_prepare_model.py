"""`./ops/run` prepares the built-in model only for a run that uses it: `rollouts prepare-model
--unless-configured` reads the run's config as the processes do and converts nothing where
model.path names a model of its own."""

import subprocess
import sys

from common.models import DEFAULT_MODEL_NAME
from ops.lib.processes import process_env
from tests.harness.processes import ROOT


def prepare(cwd, cache, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli", "prepare-model", *flags], cwd=cwd,
                          env=process_env({"ROLLOUTS_CACHE": str(cache), **(env or {})}),
                          capture_output=True, text=True, timeout=300)


def test_a_run_of_its_own_model_converts_no_default_model(tmp_path, tiny_model):
    (tmp_path / "rollouts.toml").write_text(f'[model]\npath = "{tiny_model}"\n')
    done = prepare(tmp_path, tmp_path / "cache", "--unless-configured")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"model.path is {tiny_model}: the default model is not needed" in done.stdout
    assert not (tmp_path / "cache" / "models").exists()  # nothing converted, nothing written


def test_a_run_of_the_default_model_still_prepares_it(tmp_path):
    # A cache already holding the converted model: prepare-model finds it and says where it is
    # (converting it again would take a minute), as a run that names no model.path needs it.
    ready = tmp_path / "cache" / "models" / DEFAULT_MODEL_NAME
    ready.mkdir(parents=True)
    (ready / "config.json").write_text("{}")
    (tmp_path / "rollouts.toml").write_text("[trainer]\nlr = 1e-5\n")
    done = prepare(tmp_path, tmp_path / "cache", "--unless-configured")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(ready)


def test_a_bad_config_stops_ops_run_before_anything_starts_with_the_field_named(tmp_path):
    done = prepare(tmp_path, tmp_path / "cache", "--unless-configured", env={"ROLLOUTS_TRAINER__LR": "-1"})
    assert done.returncode != 0
    assert "trainer.lr" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "cache" / "models").exists()
    assert (ROOT / "ops" / "run").read_text().count("rollouts prepare-model --unless-configured") == 1
