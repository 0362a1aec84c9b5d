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
        ("[[data.sources]]\nname = \"a\"\nkind = \"arithmetic\"\nmax_turns = 0\n", {}, "data.sources.0.max_turns"),
        ("[[data.sources]]\nname = \"a\"\nkind = \"arithmetic\"\nenvironment = \"not a module\"\n", {},
         "data.sources.0.environment"),
        ("[generator]\nengine = \"openai\"\n", {}, "generator.server_url"),
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


def test_shipped_calculator_config_names_its_environment():
    from generators.environments import environment_specs

    cfg = load_config("configs/calculator.toml", env={})
    assert {name: spec.name for name, spec in environment_specs(cfg).items()} == {"calc": "envs.calculator"}
    bad = load_config("configs/calculator.toml", env={"ROLLOUTS_DATA__SOURCES": '[{name = "calc", kind = '
                                                       '"arithmetic", environment = "envs.nothing"}]'})
    with pytest.raises(ConfigError, match="data.sources.0.environment: environment 'envs.nothing' cannot be loaded"):
        environment_specs(bad)


def test_shipped_demo_config_is_valid():
    cfg = load_config("configs/demo.toml", env={})
    assert cfg.model.path == ""
    assert cfg.rollout.max_staleness >= 0
