import pytest

from common.config import ConfigError, load_config


def write(tmp_path, text: str):
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


def test_file_then_environment_override(tmp_path):
    p = write(tmp_path, 'run = "x"\n[trainer]\nlr = 1e-5\n[task]\nops = ["*"]\n')
    cfg = load_config(p, env={"ROLLOUTS_TRAINER__LR": "3e-6", "ROLLOUTS_ROLLOUT__GROUP_SIZE": "8"})
    assert cfg.run == "x"
    assert cfg.trainer.lr == 3e-6
    assert cfg.rollout.group_size == 8
    assert cfg.task.ops == ["*"]


def test_environment_names_the_file(tmp_path):
    p = write(tmp_path, 'output_dir = "elsewhere"\n')
    assert load_config(env={"ROLLOUTS_CONFIG": str(p)}).output_dir == "elsewhere"


@pytest.mark.parametrize(
    ("text", "env", "field"),
    [
        ("[trainer]\nlr = -1.0\n", {}, "trainer.lr"),
        ("[rollout]\ngroup_size = 1\n", {}, "rollout.group_size"),
        ("[trainer]\nlearning_rate = 1.0\n", {}, "trainer.learning_rate"),
        ("", {"ROLLOUTS_GENERATOR__BATCH_PROMPTS": "many"}, "generator.batch_prompts"),
        ('redis_url = "http://localhost"\n', {}, "redis_url"),
        ("[task]\nops = [\"/\"]\n", {}, "task.ops.0"),
    ],
)
def test_bad_value_names_the_field(tmp_path, text, env, field):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), env=env)
    assert field in str(err.value)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "run = \n"), env={})


def test_shipped_demo_config_is_what_the_readme_describes():
    from tests.helpers import ROOT

    cfg = load_config(ROOT / "configs" / "demo.toml", env={})
    assert cfg.model.path == ""  # the built-in default model
    assert (cfg.run, cfg.output_dir) == ("demo", "runs/demo")  # runs/demo/..., rollouts:demo:...
    assert cfg.task.name == "arithmetic" and cfg.generator.engine == "auto"
    assert (cfg.eval.every, cfg.eval.prompts) == (10, 32)  # every tenth checkpoint, 32 held-out problems
    dotenv = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
                  if "=" in line and not line.startswith("#"))
    assert dotenv["ROLLOUTS_CONFIG"] == "configs/demo.toml" and dotenv["REDIS_PORT"] == "6390"
    assert dotenv["ROLLOUTS_REDIS_URL"] == "redis://127.0.0.1:6390/0"
