"""`rollouts status` against a real Redis holding a run's state."""

import json
import os
import re
import subprocess
import sys
from dataclasses import replace

from common.cli import main, status_lines
from common.config import config_from_dict
from common.heartbeats import Heartbeat, write_heartbeat
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.progress import count_trained, write_step
from tests.harness.metrics import STEP
from tests.harness.processes import wait_for
from trainer.tracking import Tracker


def test_status_shows_trainer_timing_and_marks_a_dead_generator(tmp_path, r, redis_url, capsys):
    keys = Keys("st")
    config = config_from_dict({"run": "st", "redis_url": redis_url, "output_dir": str(tmp_path / "run")})
    write_step(r, keys, step=7, version=6)
    count_trained(r, keys, 28)
    Tracker(r, config).log(replace(STEP, step=7, time_step=10.0, time_wait_data=2.5, staleness_mean=0.5,
                                   staleness_max=1, tokens_per_s=123.4))
    # Prompts admitted; the generator "gone" took two of them and then its heartbeat expired.
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    for i in range(3):
        r.xadd(keys.prompts, {PAYLOAD: b"x%d" % i})
    r.xreadgroup(GENERATORS_GROUP, "gone", {keys.prompts: ">"}, count=2)
    write_heartbeat(r, keys, "alive", Heartbeat(engine="hf", version=6, tokens_per_s=51.25, in_flight=1, groups=3,
                                                reward_errors=0, dropped_zero_variance=0, weights_refused=0),
                    ttl_s=60)

    screen = "\n".join(status_lines(r, "st"))
    assert "trainer    step 7  version 6  trained+saved 28" in screen
    assert "\n           last step 10.0s (waiting for data 25%)  123 tok/s  staleness 0.5 mean / 1 max" in screen
    assert "prompts    waiting 1  in flight 2  dead 0" in screen
    # the last step's headline metrics, under the names they are logged as (TRL's)
    assert ("metrics    step 7  reward 0.1  reward_std 0.2  frac_reward_zero_std 0  loss 0.1  kl 0  entropy 0.9  "
            "completions/mean_length 11  completions/clipped_ratio 0.25  learning_rate 1e-05  "
            "rewards/correct/mean 0.1  rewards/format/mean 0.5") in screen, screen
    assert re.search(r"generator  alive  hf  v6  51\.2 tok/s  in flight 1", screen), screen
    assert re.search(r"generator  gone  DEAD .* holds 2 prompts", screen), screen

    # The command itself prints the same screen from the config.
    (tmp_path / "c.toml").write_text(f'run = "st"\nredis_url = "{redis_url}"\n')
    main(["status", "--config", str(tmp_path / "c.toml")])
    assert "generator  gone  DEAD" in capsys.readouterr().out


def test_resolved_config_is_written_with_the_password_masked(tmp_path, r, redis_url):
    """docs/watching-a-run.md: `config.json` is the resolved config, "the Redis password masked":
    the URL is there, user, host, port and database as given, the password as ***; nowhere else in
    the file."""
    host = redis_url.removeprefix("redis://")
    config = config_from_dict({"run": "rc", "redis_url": f"redis://rollouts-rc:s3cret@{host}",
                               "output_dir": str(tmp_path), "trainer": {"lr": 3e-6}})
    Tracker(r, config)
    written = (tmp_path / "config.json").read_text()
    assert json.loads(written)["redis_url"] == f"redis://rollouts-rc:***@{host}", written
    assert "s3cret" not in written
    assert '"lr": 3e-06' in written and '"max_staleness"' in written  # defaults filled in


def test_metrics_reach_tensorboard_and_wandb_with_the_config(tmp_path, r, redis_url, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = config_from_dict({"run": "tb", "redis_url": redis_url, "output_dir": str(tmp_path),
                               "trainer": {"report_to": ["tensorboard", "wandb"], "wandb_project": "p"}})
    tracker = Tracker(r, config)
    for step, reward in [(1, 0.25), (2, 0.5)]:
        tracker.log(replace(STEP, step=step, reward_mean=reward, accuracy=None))
    tracker.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.5)]
    assert "config/text_summary" in events.Tags()["tensors"]
    runs = list((tmp_path / "wandb").glob("offline-run-*-tb"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    record = runs[0] / "run-tb.wandb"  # the offline run, synced later by `wandb sync`
    # wandb's own service process writes the record; it may land just after finish() returns.
    wait_for(lambda: b"rewards/correct/mean" in record.read_bytes(), timeout=60, what="the metric in the W&B record")
    assert b"wandb_project" in record.read_bytes()  # the resolved config


def test_rollouts_status_as_the_readme_gives_it_finds_the_run_through_dotenv(tmp_path, r, redis_url):
    """`.venv/bin/rollouts status` from the checkout during `./ops/run`: no flags, no variables set;
    the Redis URL and the config come from `.env`, as honcho gives them to the processes."""
    (tmp_path / "demo.toml").write_text('run = "readme"\n')
    (tmp_path / ".env").write_text(f"# read by honcho\nROLLOUTS_REDIS_URL={redis_url}\nROLLOUTS_CONFIG='demo.toml'\n")
    write_step(r, Keys("readme"), step=4, version=4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    done = subprocess.run([sys.executable, "-m", "common.cli", "status"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("run readme\n") and "trainer    step 4  version 4" in done.stdout
    # The environment still wins over .env.
    env["ROLLOUTS_RUN"] = "other"
    done = subprocess.run([sys.executable, "-m", "common.cli", "status"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("run other\n"), done.stderr
