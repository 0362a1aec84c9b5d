import re

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
        ("[trainer.loss]\ntype = \"ppo\"\n", {}, "trainer.loss.type: unknown type 'ppo'; expected one of"),
        ("[trainer.loss]\ntype = \"gspo\"\nloss_agg = \"token_mean\"\n", {},
         "trainer.loss.loss_agg: unknown field for type 'gspo'"),
        ("", {"ROLLOUTS_TRAINER__LOSS__CORRECTION__TYPE": "decoupled",
              "ROLLOUTS_TRAINER__LOSS__CORRECTION__MASK_LOW": "0.1"},
         "trainer.loss.correction.mask_low: unknown field for type 'decoupled'"),
        ("[trainer.loss]\nclip_ratio_c = 0.5\n", {}, "trainer.loss.clip_ratio_c: must be 0 (off) or > 1"),
        ("[trainer]\nclip_high = 0.28\n", {}, "trainer.clip_high: unknown field: it moved to trainer.loss.clip_high"),
        ("", {"ROLLOUTS_TRAINER__CORRECTION": "decoupled"}, "it moved to trainer.loss.correction"),
    ],
)
def test_bad_value_names_the_field(tmp_path, text, env, field):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), env=env)
    assert field in str(err.value)


@pytest.mark.parametrize(("url", "said"), [
    ("rediss://u:secret@host:notaport/0", "'rediss://u:***@host:notaport/0' is not a valid Redis URL: Port could"),
    ("redis://localhost:99999/0", "Port out of range"),
    ("redis://localhost:6379/abc", "the database after the last / must be a number, got 'abc'"),
])
def test_a_mangled_redis_url_is_a_config_error_that_hides_the_password(url, said):
    with pytest.raises(ConfigError, match=re.escape(said)) as err:
        load_config(env={"ROLLOUTS_REDIS_URL": url})
    assert "secret" not in str(err.value)
    assert load_config(env={"ROLLOUTS_REDIS_URL": "rediss://u:secret@host:6380/3"}).redis_url.endswith(":6380/3")


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "run = \n"), env={})


def test_shipped_demo_config_is_what_the_readme_describes():
    from tests.harness.processes import ROOT

    cfg = load_config(ROOT / "configs" / "demo.toml", env={})
    assert cfg.model.path == ""  # the built-in default model
    assert (cfg.run, cfg.output_dir) == ("demo", "runs/demo")  # runs/demo/..., rollouts:demo:...
    assert cfg.task.name == "arithmetic" and cfg.generator.engine == "auto"
    assert (cfg.eval.every, cfg.eval.prompts) == (10, 32)  # every tenth checkpoint, 32 held-out problems
    dotenv = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
                  if "=" in line and not line.startswith("#"))
    # honcho lets .env override the shell: it names the demo's file only as the default, and sets
    # nothing a user would choose (the config file, the Redis URL), so the environment wins.
    assert dotenv["ROLLOUTS_DEFAULT_CONFIG"] == "configs/demo.toml"
    assert not {"ROLLOUTS_CONFIG", "ROLLOUTS_REDIS_URL", "REDIS_PORT"} & set(dotenv)
    assert cfg.redis_url == load_config(env={}).redis_url == "redis://127.0.0.1:6390/0"  # the Procfile's


def test_rollouts_config_wins_over_the_default_config(tmp_path):
    (a := tmp_path / "a.toml").write_text('run = "a"\n')
    (b := tmp_path / "b.toml").write_text('run = "b"\n')
    assert load_config(env={"ROLLOUTS_DEFAULT_CONFIG": str(a)}).run == "a"
    assert load_config(env={"ROLLOUTS_DEFAULT_CONFIG": str(a), "ROLLOUTS_CONFIG": str(b)}).run == "b"
    assert load_config(b, env={"ROLLOUTS_DEFAULT_CONFIG": str(a)}).run == "b"  # --config over both


def test_the_documented_variables_that_name_no_field_are_not_taken_for_fields():
    # README: ROLLOUTS_CACHE moves the prepared model, ROLLOUTS_NO_VLLM=1 ./ops/test leaves vLLM out;
    # both reach every process ./ops/run starts, which stopped on "cache: unknown field".
    env = {"ROLLOUTS_CACHE": "/tmp/x", "ROLLOUTS_NO_VLLM": "1", "ROLLOUTS_RUN": "r"}
    assert load_config(env=env).run == "r"


# ---------------------------------------------------------------------- the command line


def test_config_files_stack_and_flags_override_files_and_environment(tmp_path, monkeypatch):
    from common.config import config_from_args

    (tmp_path / "a.toml").write_text('run = "a"\n[trainer]\nlr = 2e-6\nmax_steps = 5\n[rollout]\ngroup_size = 3\n')
    (tmp_path / "b.toml").write_text('[trainer]\nmax_steps = 7\n')
    monkeypatch.setenv("ROLLOUTS_ROLLOUT__GROUP_SIZE", "6")
    monkeypatch.setenv("ROLLOUTS_TRAINER__LR", "3e-6")
    cfg, _ = config_from_args("python -m trainer", "", [
        "--config", str(tmp_path / "a.toml"), "--config", str(tmp_path / "b.toml"), "--trainer.lr", "1e-5",
        "--trainer.report_to", "tensorboard", "--trainer.report_to", "wandb", "--generator.drop_zero_variance",
        "--data.sources", '{"name": "g", "path": "x.jsonl", "prompt_column": "q"}'])
    assert cfg.run == "a" and cfg.trainer.max_steps == 7  # b over a
    assert cfg.rollout.group_size == 6  # the environment over the files
    assert cfg.trainer.lr == 1e-5  # a flag over the environment
    assert cfg.trainer.report_to == ["tensorboard", "wandb"] and cfg.generator.drop_zero_variance
    assert [s.name for s in cfg.data.sources] == ["g"]
    with pytest.raises(ConfigError, match=r"trainer\.lr"):
        config_from_args("python -m trainer", "", ["--trainer.lr", "-1"])


def test_the_loss_is_chosen_by_type_from_files_environment_and_flags(tmp_path, monkeypatch):
    from common.config import BehaviourClip, Decoupled, GrpoLoss, GspoLoss, TokenMask, config_from_args

    (tmp_path / "a.toml").write_text('[trainer.loss]\ntype = "gspo"\nclip_low = 3e-4\nclip_high = 4e-4\n'
                                     '[trainer.loss.correction]\ntype = "token_mask"\nmask_low = 0.25\n')
    assert load_config(tmp_path / "a.toml", env={}).trainer.loss == GspoLoss(
        clip_low=3e-4, clip_high=4e-4, correction=TokenMask(mask_low=0.25))
    assert load_config(env={}).trainer.loss == GrpoLoss(correction=BehaviourClip())  # the default
    # A bare type name is that variant with its defaults; a table without `type` is the default variant.
    assert load_config(env={"ROLLOUTS_TRAINER__LOSS": "gspo"}).trainer.loss == GspoLoss()
    assert load_config(env={"ROLLOUTS_TRAINER__LOSS__KL_COEF": "0.1", "ROLLOUTS_TRAINER__LOSS__CORRECTION":
                            "decoupled"}).trainer.loss == GrpoLoss(kl_coef=0.1, correction=Decoupled())
    (tmp_path / "b.toml").write_text('[trainer.loss]\ntype = "gspo"\nclip_low = 3e-4\nclip_high = 4e-4\n')
    monkeypatch.setenv("ROLLOUTS_TRAINER__LOSS__CLIP_HIGH", "5e-4")
    cfg, _ = config_from_args("python -m trainer", "", [
        "--config", str(tmp_path / "b.toml"), "--trainer.loss.correction.type", "decoupled",
        "--trainer.loss.correction.tis_cap", "3"])
    assert cfg.trainer.loss == GspoLoss(clip_low=3e-4, clip_high=5e-4, correction=Decoupled(tis_cap=3.0))
    # a.toml's token_mask band does not belong to the decoupled correction a flag chose
    with pytest.raises(ConfigError, match=r"trainer\.loss\.correction\.mask_low: unknown field for type 'decoupled'"):
        config_from_args("python -m trainer", "", ["--config", str(tmp_path / "a.toml"),
                                                   "--trainer.loss.correction.type", "decoupled"])


def test_help_lists_every_field_with_its_comment_and_default_and_the_processes():
    import subprocess
    import sys

    from common.config import Config

    shown = subprocess.run([sys.executable, "-m", "trainer", "--help"], capture_output=True, text=True,
                           check=True).stdout
    flat = " ".join(shown.split())
    for top, info in Config.model_fields.items():
        section = getattr(info.annotation, "model_fields", None)  # None: a top-level field (run, redis_url)
        for flag, field in ({f"--{top}.{n}": f for n, f in section.items()} if section else {f"--{top}": info}).items():
            assert flag in shown, flag
            assert field.description, f"{flag} has no comment in common/config.py"
    assert "--trainer.lr float Peak learning rate (AdamW); the schedule scales it. (default: 1e-06)" in flat
    assert "--rollout.group_size int Completions sampled per prompt (the GRPO group). (default: 4)" in flat
    for flag in ("--trainer.loss.type {cispo,custom,grpo,gspo}", "--trainer.loss.clip_high float Upper clip bound",
                 "--trainer.loss.correction.type {behaviour_clip,decoupled,sequence_mask,token_mask}",
                 "--trainer.loss.correction.tis_cap float Cap of the behaviour weight"):
        assert flag in flat, flag
    assert "Each type takes only its own settings. (default: grpo)" in flat  # the type's default is grpo's
    processes = subprocess.run([sys.executable, "-m", "common.cli", "--help"], capture_output=True, text=True,
                               check=True).stdout
    for start in ("python -m producers", "python -m generators", "-m trainer", "python -m evaluator", "./ops/run"):
        assert start in processes, start


def test_a_process_refuses_a_bad_flag_naming_the_field():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "producers", "--rollout.group_size", "1"], capture_output=True,
                          text=True)
    assert done.returncode != 0, done.stderr
    assert "rollout.group_size: Input should be greater than or equal to 2 (got '1')" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "trainer", "--trainer.loss.type", "ppo"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "trainer.loss.type: unknown type 'ppo'" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "trainer", "--trainer.loss.type", "custom",
                           "--trainer.loss.function", "nowhere.at_all:loss"], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "trainer.loss.function 'nowhere.at_all:loss' cannot be loaded: No module named 'nowhere'" in done.stderr


def test_every_process_exits_2_with_the_same_lines_on_the_same_bad_config(tmp_path):
    """One wrapper runs every process's main (common/process.py): a bad value in the config file
    stops each of the four with status 2 and the same message, under its own name."""
    import subprocess
    import sys

    p = write(tmp_path, "[rollout]\ngroup_size = 1\n")
    said = {}
    for process, module in (("producer", "producers"), ("generator", "generators"), ("trainer", "trainer"),
                            ("evaluator", "evaluator")):
        done = subprocess.run([sys.executable, "-m", module, "--config", str(p)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, (process, done.returncode, done.stderr)
        assert "Traceback" not in done.stderr and done.stderr.startswith(f"{process}: "), done.stderr
        said[process] = done.stderr.removeprefix(f"{process}: ")
    assert "rollout.group_size: Input should be greater than or equal to 2 (got 1)" in said["trainer"], said
    assert len(set(said.values())) == 1, said


def test_shipped_gsm8k_config_trains_on_the_train_split_and_evaluates_on_the_test_split():
    from tests.harness.processes import ROOT

    cfg = load_config(ROOT / "configs" / "gsm8k.toml", env={})
    assert (cfg.model.path, cfg.model.dtype) == ("Qwen/Qwen2.5-0.5B-Instruct", "bfloat16")
    [train], [test] = cfg.data.sources, cfg.eval.sources
    assert (train.path, train.subset, train.split) == ("openai/gsm8k", "main", "train")
    assert (test.path, test.subset, test.split) == ("openai/gsm8k", "main", "test")
    assert (test.template, test.answer_extractor) == (train.template, train.answer_extractor)
    assert cfg.eval.every > 0


def test_shipped_calculator_config_names_its_environment():
    from generators.environments import environment_specs

    cfg = load_config("configs/calculator.toml", env={})
    assert {name: spec.name for name, spec in environment_specs(cfg).items()} == {"calc": "envs.calculator"}
    bad = load_config("configs/calculator.toml", env={"ROLLOUTS_DATA__SOURCES": '[{name = "calc", kind = '
                                                       '"arithmetic", environment = "envs.nothing"}]'})
    with pytest.raises(ConfigError, match="data.sources.0.environment: environment 'envs.nothing' cannot be loaded"):
        environment_specs(bad)
