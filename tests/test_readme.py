"""The README as an executable spec: every fenced command and config block of README.md and of
the docs pages it sends a reader on to for the reference (DOCS) runs here as written, in a scratch
copy of the checkout, or is listed in NOT_RUN with the reason it cannot run on this machine. A
block is found by its text wherever it is in those pages, so moving it from one page to another
keeps its test; a block added to any of them without either, or a page of the README's reference
left out of DOCS, fails `test_every_block_runs_here_or_says_why_not`.

What stands in for what this machine lacks, and nothing else:
- the model: `ROLLOUTS_MODEL__PATH` (README "Bring your own model") names a tiny model built in the
  test, in place of the built-in or a hub model; a command that sets it itself keeps its own;
- a hub data set: a local directory of the same name and GSM8K's layout (`openai/gsm8k/main/...`,
  which `datasets.load_dataset` reads before the hub) holds a few hundred GSM8K-shaped problems;
- a user's own files the README asks for (`data/train.jsonl`, `my_rewards.py`, conversations):
  written from the README's own text where it gives them, GSM8K-shaped otherwise;
- Redis's port: `REDIS_PORT` and `ROLLOUTS_REDIS_URL` name a free one, so a run of yours on 6390
  never meets the tests';
- GPUs: CPU processes (gloo), and fewer of them where the README starts one per GPU.

Commands run through `bash -c` in their own session, as a terminal runs them; "Ctrl-C" is SIGINT to
that session's process group, as a terminal sends it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from common.keys import Keys
from common.recording import replay
from common.tiny import GSM8K_TEMPLATE, write_gsm8k
from tests.harness.metrics import read_steps
from tests.harness.processes import ROOT, Shell, run_once, wait_for
from tests.harness.servers import free_port, start_redis

# The README and the reference it links to: docs/benchmarks.md, gpu.md, offpolicy.md and reliability.md
# are records of measurements (each block there a command whose figures the page gives), not run here.
DOCS = ("README.md", "docs/configuration.md", "docs/generators.md", "docs/operations.md", "docs/rewards-and-data.md",
        "docs/scaling.md", "docs/training.md", "docs/watching-a-run.md")
RECORDS = ("docs/benchmarks.md", "docs/gpu.md", "docs/offpolicy.md", "docs/reliability.md", "docs/tests.md")
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    doc: str
    lang: str
    text: str  # dedented

    @property
    def keys(self) -> list[str]:
        """A shell block's commands, one per line (comments cut); a config block, its first two lines;
        any other, its first line."""
        if self.lang in ("bash", "sh"):
            return [command(line) for line in self.text.splitlines() if command(line)]
        lines = self.text.splitlines()[: 2 if self.lang == "toml" else 1]
        return [f"{self.lang or 'text'}: " + "\n".join(re.sub(r"\s+#.*$", "", line.strip()) for line in lines)]


def command(line: str) -> str:
    return re.sub(r"\s+#.*$", "", line.strip()) if not line.strip().startswith("#") else ""


def blocks() -> list[Block]:
    out = []
    for doc in DOCS:
        for indent, lang, text in FENCE.findall((ROOT / doc).read_text()):
            text = "\n".join(line.removeprefix(indent) for line in text.splitlines())
            out.append(Block(doc, lang, text))
    return out


def block(key: str) -> Block:
    found = [b for b in blocks() if key in b.keys]
    assert len(found) == 1, f"{key!r} is in {len(found)} blocks of {DOCS}"
    return found[0]


MINE = 'toml: [[data.sources]]\nname = "mine"'
TRL = ("toml: # my_rewards.py, importable from where the generators run:\n"
       "#   import re")
CALC = 'toml: [[data.sources]]\nname = "calc"'
EVAL = 'toml: [[eval.sources]]\nname = "gsm8k"'
TEACHER = 'toml: [teacher]\npath = "models/teacher"'
RM = 'toml: [[data.sources]]\nname = "rm"'
JUDGED = 'toml: [[data.sources]]\nname = "judged"'
CHECK_OUTPUT = ("text: check: 4 prompts from arithmetic, 4 completions each, vllm engine at temperature 0.8; "
                "trainer float32 on cpu at rollout.temperature 0.8")
QUARANTINED = ("text: generator  hot  QUARANTINED: quarantined at step 13 (strike 2, stopped sampling): mean "
               "|log pi_trainer - log pi_behaviour| 0.0894 over its last 2 groups (hf engine, staleness 1/2), above "
               "0.01 and 4x the other generators at that staleness: it samples with other weights or other settings "
               "(temperature, top_p, top_k) than the trainer's, or its engine is broken")
ADD2 = ("ROLLOUTS_TASK__MAX_OPERAND=99 ROLLOUTS_TASK__OPS='[\"+\"]' ROLLOUTS_ROLLOUT__TEMPERATURE=1.2 "
        "ROLLOUTS_RUN=add2 ROLLOUTS_OUTPUT_DIR=runs/add2 ./ops/run")
ADD2_PLOT = "ROLLOUTS_RUN=add2 ROLLOUTS_OUTPUT_DIR=runs/add2 .venv/bin/rollouts plot --config configs/demo.toml"
POOL_RUNS = {"add": 'toml: # add.toml\nrun = "add"', "countdown": 'toml: # countdown.toml\nrun = "countdown"'}
POOL = ".venv/bin/python -m generators --id pool --runs add.toml,countdown.toml"
MOE = 'toml: # moe.toml\nrun = "moe"'
MOE_CHECK = "ROLLOUTS_CONFIG=moe.toml .venv/bin/rollouts check"
MOE_RUN = "ROLLOUTS_CONFIG=moe.toml ./ops/run"
SHAPES = 'toml: # shapes.toml\nrun = "shapes"'
SHAPES_RUN = "ROLLOUTS_CONFIG=shapes.toml ./ops/run"
# Each block (by its key) and the test that runs it as written.
RUN = {
    "./ops/run": "test_ops_run_trains_the_demo_status_and_plot_show_it_and_a_second_start_resumes_it",
    "text: trainer.1   | step   24 | reward 0.500 | acc 0.500 | len  16.7 | stale 1.0/1 | loss +0.0173 | "
    "ent 0.910 | lr 1.00e-05 | 13.91s":
        "test_ops_run_trains_the_demo_status_and_plot_show_it_and_a_second_start_resumes_it",
    ".venv/bin/rollouts status": "test_ops_run_trains_the_demo_status_and_plot_show_it_and_a_second_start_resumes_it",
    ".venv/bin/rollouts plot --config configs/demo.toml":
        "test_ops_run_trains_the_demo_status_and_plot_show_it_and_a_second_start_resumes_it",
    ".venv/bin/rollouts check": "test_rollouts_check_as_written_passes_on_the_demo_config",
    CHECK_OUTPUT: "test_rollouts_check_as_written_passes_on_the_demo_config",
    ".venv/bin/rollouts view": "test_rollouts_view_as_written_serves_the_runs_groups_until_ctrl_c",
    "./ops/run -c generator=4":
        "test_ops_run_trains_the_demo_status_and_plot_show_it_and_a_second_start_resumes_it",
    ADD2: "test_what_you_see_two_digit_addition_at_temperature_1_2_as_written",
    ADD2_PLOT: "test_what_you_see_two_digit_addition_at_temperature_1_2_as_written",
    "ROLLOUTS_CONFIG=configs/gsm8k.toml ./ops/run": "test_the_one_gpu_command_runs_the_gsm8k_config",
    MINE: "test_your_own_data_a_trl_reward_and_an_evaluation_source",
    TRL: "test_your_own_data_a_trl_reward_and_an_evaluation_source",
    CALC: "test_your_own_data_a_trl_reward_and_an_evaluation_source",
    EVAL: "test_your_own_data_a_trl_reward_and_an_evaluation_source",
    TEACHER: "test_a_teacher_a_reward_model_and_a_judge_as_written",
    RM: "test_a_teacher_a_reward_model_and_a_judge_as_written",
    JUDGED: "test_a_teacher_a_reward_model_and_a_judge_as_written",
    "ROLLOUTS_CONFIG=configs/sft.toml ./ops/run redis producer trainer": "test_sft_then_rl_from_its_checkpoint",
    "ROLLOUTS_RUN=rl ROLLOUTS_OUTPUT_DIR=runs/rl ROLLOUTS_MODEL__PATH=runs/sft/checkpoints/step_200 ./ops/run":
        "test_sft_then_rl_from_its_checkpoint",
    "export ROLLOUTS_CONFIG=configs/gsm8k.toml": "test_the_eight_gpu_split_runs_on_cpu_processes",
    "CUDA_VISIBLE_DEVICES=4,5,6,7 ./ops/run -c generator=4 redis producer generator &":
        "test_the_eight_gpu_split_runs_on_cpu_processes",
    "CUDA_VISIBLE_DEVICES=0,1,2,3 .venv/bin/torchrun --nproc-per-node 4 -m trainer":
        "test_the_eight_gpu_split_runs_on_cpu_processes",
    "text: ACL SETUSER rollouts-demo on >a-long-random-password resetkeys ~rollouts:demo:* ~rq:* resetchannels "
    "&rq:* +@all -@dangerous +info": "test_the_acl_user_of_operations_md_is_confined_to_its_run",
    **dict.fromkeys([*POOL_RUNS.values(), "./ops/run redis &", "for run in add countdown; do",
                     "ROLLOUTS_CONFIG=$run.toml .venv/bin/python -m producers &",
                     "ROLLOUTS_CONFIG=$run.toml .venv/bin/python -m trainer &", "done", POOL],
                    "test_two_runs_train_on_one_generator_killed_and_started_again"),
    **dict.fromkeys([MOE, MOE_CHECK, MOE_RUN], "test_an_moe_run_with_routing_replay_as_written"),
    **dict.fromkeys([SHAPES, SHAPES_RUN], "test_a_vision_language_run_on_shapes_as_written"),
}
# Each block that does not run here, and why.
NOT_RUN = {
    "./ops/test": "the test suite itself: .ci/run runs it on a fresh clone",
    "ROLLOUTS_CONFIG=configs/gsm8k.toml TRAINER_NODES=2 TRAINER_PROCS_PER_NODE=gpu GENERATORS_PER_NODE=gpu sbatch "
    "--nodes 4 ops/slurm/rollouts.sbatch":
        "four GPU nodes of a Slurm cluster: tests/test_slurm.py submits this script to a one-host Slurm of its own, "
        "on the tiny model",
    "text: producer ──prompts stream──▶ generator × N ──samples stream──▶ trainer": "a picture, not a command",
    QUARANTINED: "output, not a command: tests/test_quarantine.py's live run reads such a line from rollouts status",
    ".venv/bin/python ops/bench/vs_trl.py --minutes 10 --sides trl rollouts rollouts-hf":
        "a 30-minute benchmark that installs TRL from PyPI (docs/benchmarks.md section 13): "
        "tests/test_vs_trl_bench.py runs its rollouts side for a minute on the tiny model, its job and its reading "
        "of the curves",
    "./ops/gpu-check": "a GPU host's check: tests/test_gpu_check.py runs it with --dry-run, the same steps on this CPU "
    "with the tiny model",
}


def test_every_block_runs_here_or_says_why_not():
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(DOCS[1:]) | set(RECORDS), \
        f"docs pages neither run here (DOCS) nor records (RECORDS): {sorted(pages - set(DOCS) - set(RECORDS))}"
    keys = [k for b in blocks() for k in b.keys]
    missing = [k for k in keys if k not in RUN and k not in NOT_RUN]
    assert not missing, f"blocks of {DOCS} that no test runs and NOT_RUN does not explain: {missing}"
    stale = [k for k in (*RUN, *NOT_RUN) if k not in keys]
    assert not stale, f"listed here but in no block of {DOCS} any more: {stale}"
    tests = {name for name in globals() if name.startswith("test_")}
    assert set(RUN.values()) <= tests, set(RUN.values()) - tests
    twice = sorted({k for k in RUN if keys.count(k) > 1})
    assert not twice, f"blocks run by their text that are in more than one place of {DOCS}: {twice}"


def config_block(key: str) -> str:
    return block(key).text


# ---------------------------------------------------------------------- the scratch checkout


def trainer_steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^\S+ trainer\.1\s+\| step\s+(\d+) \|", text, re.M)]


def line_pattern(example: str) -> str:
    """A regex for lines shaped like `example`: its numbers stand for any number, its spaces for any."""
    out = []
    for part in re.split(r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?s?|\s+)", example):
        if not part:
            continue
        if part.isspace():
            out.append(r"\s+")
        elif re.fullmatch(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?s?", part):
            out.append(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?" + ("s" if part.endswith("s") else ""))
        else:
            out.append(re.escape(part))
    return "".join(out)


# ---------------------------------------------------------------------- the demo


@pytest.mark.slow  # two whole demo runs (about two minutes): the slow checks, to keep the default suite short
def test_ops_run_trains_the_demo_status_and_plot_show_it_and_a_second_start_resumes_it(checkout, user_env,
                                                                                        tmp_path):
    (example,) = block("text: trainer.1   | step   24 | reward 0.500 | acc 0.500 | len  16.7 | stale 1.0/1 | "
                       "loss +0.0173 | ent 0.910 | lr 1.00e-05 | 13.91s").text.splitlines()
    run = Shell("./ops/run", cwd=checkout, env=user_env, log=tmp_path / "run.log")
    try:
        run.wait_for(r"trainer\.1\s+\| step\s+3 \|", timeout=420, what="./ops/run's third step")
        status = run_once(".venv/bin/rollouts status", cwd=checkout, env=user_env)
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith("run demo\n"), status.stdout
        assert re.search(r"^trainer\s+step \d+\s+version \d+", status.stdout, re.M), status.stdout
        assert re.search(r"^generator\s+\S+\s+(vllm|hf)\s+v\d+", status.stdout, re.M), status.stdout
        run.ctrl_c()
    finally:
        run.kill()
    first = run.text()
    # The trainer's lines are the README's, field for field.
    lines = [line for line in first.splitlines() if re.match(r"^\S+ trainer\.1\s+\| step ", line)]
    assert len(lines) >= 3 and all(re.fullmatch(line_pattern(example), line.split(" ", 1)[1]) for line in lines), \
        (example, lines[:3])
    assert "trainer: run 'demo'" in first and "SIGINT received" in first
    stopped = int(re.search(r"trainer: stopped at step (\d+)", first)[1])

    plot = run_once(block(".venv/bin/rollouts plot --config configs/demo.toml").text, cwd=checkout, env=user_env)
    assert plot.returncode == 0, plot.stderr
    assert (checkout / "runs/demo/metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Run again, with four generators: the run goes on from where it stopped.
    again = Shell("./ops/run -c generator=4", cwd=checkout, env=user_env, log=tmp_path / "again.log")
    try:
        again.wait_for(r"trainer\.1\s+\| step\s+\d+ \|", timeout=420, what="the resumed run's first step")
        for n in range(1, 5):
            again.wait_for(rf"generator\.{n}\s+\| generator \S+ v\d+: \d+ groups written", timeout=420,
                           what=f"generator {n} writing groups")
        again.ctrl_c()
    finally:
        again.kill()
    assert trainer_steps(again.text())[0] == stopped + 1, (stopped, trainer_steps(again.text())[:3])


def test_what_you_see_two_digit_addition_at_temperature_1_2_as_written(checkout, user_env, tmp_path):
    """"What you see": the ten-minute run's command as written (here for a few steps, on the tiny
    model) trains its own run on 2-digit addition sampled at temperature 1.2, and its plot command
    charts that run."""
    run_line, plot_line = block(ADD2).keys
    run = Shell(run_line, cwd=checkout, env=user_env, log=tmp_path / "run.log")
    try:
        run.wait_for(r"trainer\.1\s+\| step\s+2 \|", timeout=420, what="the run's second step")
        run.ctrl_c()
    finally:
        run.kill()
    assert "trainer: run 'add2'" in run.text()
    config = json.loads((checkout / "runs/add2/config.json").read_text())
    assert (config["task"]["max_operand"], config["task"]["ops"], config["rollout"]["temperature"]) == (99, ["+"], 1.2)
    assert not (checkout / "runs/demo").exists()  # the demo's own run is left alone
    plot = run_once(plot_line, cwd=checkout, env=user_env)
    assert plot.returncode == 0, plot.stderr
    assert (checkout / "runs/add2/metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rollouts_check_as_written_passes_on_the_demo_config(checkout, user_env):
    """`rollouts check` as written (the demo config from `.env`, the tiny model standing in), its
    report shaped as the README's example: the same lines, each starting as the example's does."""
    done = run_once(block(".venv/bin/rollouts check").text, cwd=checkout, env=user_env, timeout=420)
    assert done.returncode == 0, done.stdout + done.stderr
    labels = [line[:11] for line in block(CHECK_OUTPUT).text.splitlines()]
    report = [line for line in done.stdout.splitlines() if not line.startswith("check: warning: ")]
    assert [line[:11] for line in report] == labels, done.stdout  # a warning: every reward 0 on the tiny model
    assert report[0].startswith("check: 4 prompts from arithmetic, 4 completions each, ")
    assert report[-1].startswith("check: ok (mean |log-ratio| "), done.stdout


def test_rollouts_view_as_written_serves_the_runs_groups_until_ctrl_c(checkout, user_env, tmp_path):
    """`rollouts view` as written (the demo config from `.env`, the tiny model standing in) over the
    demo run's samples stream, here the checked-in recording's groups (sampled with the tiny model)
    replayed into it; Ctrl-C stops it."""
    port = int(user_env["REDIS_PORT"])
    server = start_redis(tmp_path / "redis", port)
    view = None
    try:
        replay(redis.Redis(port=port), Keys("demo"), ROOT / "tests" / "data" / "tiny_pipeline.rec", only=["samples"])
        view = Shell(block(".venv/bin/rollouts view").text, cwd=checkout, env=user_env, log=tmp_path / "view.log")
        url = view.wait_for(r"rollouts view: run 'demo' at (http://127\.0\.0\.1:\d+/) \(Ctrl-C stops\)",
                            timeout=180, what="the page's address")[1]
        with urllib.request.urlopen(url, timeout=60) as reply:
            page = reply.read().decode()
        assert "20 groups read from the samples stream of run &#39;demo&#39;" in page, page[:3000]
        assert page.count('<section class="group"') == 20 and "What is 16 + 0? Answer with just the number." in page
        os.killpg(view.proc.pid, signal.SIGINT)
        assert view.wait(60) == 0, view.text()[-3000:]
        assert "rollouts view: stopped" in view.text()
    finally:
        if view is not None:
            view.kill()
        server.terminate()
        server.wait(timeout=30)


# ---------------------------------------------------------------------- GPUs, on CPU processes


@pytest.fixture
def long_tiny_model(tmp_path_factory) -> Path:
    """The tiny model with room for configs/gsm8k.toml's max_model_len (1024)."""
    from common.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-long") / "model", max_positions=1024)


# configs/gsm8k.toml's step is 32 prompts x 8 completions of up to 512 tokens: on the CPU, with the
# tiny model (which seldom stops early), two steps of it took 6-8 minutes of the slow checks. The
# runs below keep the config's run, sources, engine and evaluation, at 8 prompts of up to 128 tokens.
CPU_SIZED_POOL = {"ROLLOUTS_ROLLOUT__PROMPTS_PER_STEP": "2", "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "16"}
CPU_SIZED_GSM8K = {"ROLLOUTS_ROLLOUT__PROMPTS_PER_STEP": "8", "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "128"}


@pytest.mark.slow
def test_the_one_gpu_command_runs_the_gsm8k_config(checkout, user_env, tmp_path, long_tiny_model):
    """The environment wins over .env: the command trains configs/gsm8k.toml's run, not the demo, and
    the evaluator scores its [[eval.sources]] (GSM8K's test split) with pass@1 and pass@4. What a
    CPU forces besides the model and the data: an evaluation at version 2 of 16 problems (the
    config: every 10th, 256), and steps of 8 prompts of up to 128 tokens (CPU_SIZED_GSM8K)."""
    write_gsm8k(checkout)
    env = {**user_env, **CPU_SIZED_GSM8K, "ROLLOUTS_MODEL__PATH": str(long_tiny_model), "ROLLOUTS_EVAL__EVERY": "2",
           "ROLLOUTS_EVAL__PROMPTS": "16"}
    run = Shell(block("ROLLOUTS_CONFIG=configs/gsm8k.toml ./ops/run").text, cwd=checkout, env=env,
                log=tmp_path / "run.log")
    try:
        run.wait_for(r"trainer\.1\s+\| step\s+2 \|", timeout=900, what="the gsm8k run's second step")
        run.wait_for(r"evaluator\.1\s+\| evaluator: version 2: pass@1", timeout=900, what="version 2's evaluation")
        run.ctrl_c(timeout=600)
    finally:
        run.kill()
    out = run.text()
    assert "trainer: run 'gsm8k'" in out and "run 'demo'" not in out, out[-4000:]
    rows = read_steps(checkout / "runs/gsm8k/metrics.jsonl")
    assert len(rows) >= 2 and not (checkout / "runs/demo").exists()
    (evaluated,) = [json.loads(x) for x in (checkout / "runs/gsm8k/evals.jsonl").read_text().splitlines()
                    if json.loads(x).get("version") == 2]
    assert {"eval/gsm8k-test/pass@1", "eval/gsm8k-test/pass@4"} <= set(evaluated), evaluated


@pytest.mark.parametrize("launcher", ["./ops/run", ".venv/bin/honcho start"])
def test_a_variable_set_when_calling_the_launcher_wins_over_dotenv(checkout, user_env, tmp_path, launcher):
    """docs/configuration.md: ROLLOUTS_CONFIG set when calling ./ops/run or plain honcho wins over
    .env, so the processes run that config's run; under ./ops/run the environment wins for every
    name .env sets too (plain honcho lets .env win for those, which is why .env sets no other)."""
    write_gsm8k(checkout)
    env = {**user_env, "ROLLOUTS_CONFIG": "configs/gsm8k.toml", "TOKENIZERS_PARALLELISM": "true"}
    run = Shell(f"{launcher} redis producer", cwd=checkout, env=env, log=tmp_path / "run.log")
    try:
        run.wait_for(r"producer\.1\s+\| producer: admitted", timeout=300, what="the producer admitting")
        pid = int(re.search(r"producer\.1 started \(pid=(\d+)\)", run.text())[1])
        seen = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    finally:
        run.kill()
    assert "producer: run 'gsm8k'" in run.text(), run.text()[-3000:]
    assert seen["ROLLOUTS_CONFIG"] == "configs/gsm8k.toml"
    assert seen["TOKENIZERS_PARALLELISM"] == ("true" if launcher == "./ops/run" else "false")


@pytest.mark.slow
def test_the_eight_gpu_split_runs_on_cpu_processes(checkout, user_env, tmp_path, long_tiny_model):
    """README "One 8-GPU node": honcho for Redis, the producer and generators, torchrun for the
    trainer; here two generators and two trainer ranks on the CPU (gloo) instead of four and four."""
    write_gsm8k(checkout)
    script = block("export ROLLOUTS_CONFIG=configs/gsm8k.toml").text
    script = script.replace("-c generator=4", "-c generator=2").replace("--nproc-per-node 4", "--nproc-per-node 2")
    env = {**user_env, **CPU_SIZED_GSM8K, "ROLLOUTS_MODEL__PATH": str(long_tiny_model),
           "ROLLOUTS_TRAINER__MAX_STEPS": "2"}
    # torchrun returns once the trainer reaches max_steps; then the honcho half is stopped.
    run = Shell(script + "\necho torchrun exited $?\nkill -TERM %1; wait %1", cwd=checkout, env=env,
                log=tmp_path / "run.log")
    try:
        run.wait(timeout=1500)
    finally:
        run.kill()
    assert "torchrun exited 0" in run.text(), run.text()[-6000:]
    assert "trainer: run 'gsm8k'" in run.text() and "2 rank(s) on cpu" in run.text(), run.text()[-6000:]
    rows = read_steps(checkout / "runs/gsm8k/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2], rows


# ---------------------------------------------------------------------- your own data


@pytest.mark.slow  # a whole run with an evaluator (about two minutes): the slow checks
def test_your_own_data_a_trl_reward_and_an_evaluation_source(checkout, user_env, tmp_path):
    """README "Bring your own model, data and reward" and docs/rewards-and-data.md's "Agents" and
    "Evaluation": their blocks added to the demo's config (your data with the TRL reward, mixed with
    the calculator's episodes as a second source, and an evaluation source), the README's file
    layout (question, answer ending in `#### 42`), its TRL reward function from its comment."""

    from common.keys import PAYLOAD, Keys
    from common.messages import decode_group

    own, trl, calc, evals = (config_block(k) for k in (MINE, TRL, CALC, EVAL))
    code = "\n".join(line.removeprefix("#   ") for line in trl.splitlines()
                     if line.startswith("#   "))
    (checkout / "my_rewards.py").write_text(code + "\n")
    data = checkout / "data"
    data.mkdir()
    rows = [{"question": GSM8K_TEMPLATE.format(a=a, b=b), "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a in range(1, 41) for b in range(1, 6)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:160]))
    (data / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[160:]))
    config = checkout / "configs/demo.toml"
    config.write_text(config.read_text() + "\n" + own + "\n" + trl + "\n" + calc + "\n" + evals)
    source = tomllib.loads(config.read_text())["data"]["sources"][0]
    assert source["reward_funcs"] == ["my_rewards:reward_func", "tasks.format:reward"]  # the blocks' source

    run = Shell("./ops/run", cwd=checkout, env={**user_env, "ROLLOUTS_EVAL__EVERY": "2"},
                log=tmp_path / "run.log")
    # The groups' sources, read as they are written: the trainer trims what it acknowledged from
    # the stream at each save of its state (every 10 steps on the demo), and on a loaded machine the
    # evaluation below may come after one (seen once: an empty stream).
    sources, seen = set(), "-"
    r = redis.Redis.from_url(user_env["ROLLOUTS_REDIS_URL"])

    def evaluated_with_both_sources() -> bool:
        nonlocal seen
        try:
            entries = r.xrange(Keys("demo").samples, min=f"({seen}" if seen != "-" else "-")
        except redis.ConnectionError:  # redis-server not up yet
            return False
        for entry_id, f in entries:
            sources.add(decode_group(f[PAYLOAD]).id.split(":")[0])
            seen = entry_id.decode()
        return sources >= {"mine", "calc"} and bool(re.search(r"evaluator\.1\s+\| evaluator: version \d+: pass@1",
                                                             run.text(), re.M))
    try:
        try:
            wait_for(evaluated_with_both_sources, timeout=600, procs=[run.proc],
                     what="groups of both sources and an evaluation on the eval source")
        except AssertionError as e:
            raise AssertionError(f"{e}; sources seen: {sources}\n{run.text()[-6000:]}") from None
        assert sources == {"mine", "calc"}, sources
        run.ctrl_c()
    finally:
        run.kill()
    metrics = read_steps(checkout / "runs/demo/metrics.jsonl")
    assert metrics and all(m["reward_errors"] == 0 for m in metrics), [m.get("reward_errors") for m in metrics]
    assert any("rewards/reward_func/mean" in m for m in metrics), sorted(metrics[0])  # steps of calc only lack it
    evaluated = [json.loads(x) for x in (checkout / "runs/demo/evals.jsonl").read_text().splitlines()]
    assert any("eval/gsm8k/pass@1" in e for e in evaluated), evaluated


@pytest.mark.slow  # a whole run with a teacher, a reward model and a judge (about two minutes): the slow checks
def test_a_teacher_a_reward_model_and_a_judge_as_written(checkout, user_env, tmp_path, tiny_model):
    """README "Teacher, reward model, judge": its three blocks added to the demo's config, with tiny
    models where they name theirs (a copy of the student as teacher, a one-label classifier, a judge
    that says yes to every question): the run trains on both sources, each step with the teacher's
    KL, and the reward model's and the judge's components score without an error."""
    import shutil

    from tests.harness.scorers import classifier, rule_judge

    teacher, rm, judged = (config_block(k) for k in (TEACHER, RM, JUDGED))
    models = checkout / "models"
    shutil.copytree(tiny_model, models / "teacher")  # the student's tokenizer, as the teacher needs
    classifier(models / "my-rm", tiny_model)
    rule_judge(models / "my-judge", tiny_model, says_yes=lambda token: True)
    config = checkout / "configs/demo.toml"
    config.write_text(config.read_text() + "\n" + teacher + "\n" + rm + "\n" + judged)
    parsed = tomllib.loads(config.read_text())
    assert parsed["teacher"]["path"] == "models/teacher"  # the blocks' tables, as written
    assert [s["name"] for s in parsed["data"]["sources"]] == ["rm", "judged"]

    run = Shell("./ops/run redis producer generator trainer", cwd=checkout, env=user_env, log=tmp_path / "run.log")
    wanted = {"teacher_kl", "rewards/my-rm/mean", "rewards/format/mean", "rewards/my-judge/mean"}
    path = checkout / "runs/demo/metrics.jsonl"

    def scored_by_all() -> bool:
        return path.exists() and set().union(*(m.keys() for m in read_steps(path))) >= wanted
    try:
        try:
            wait_for(scored_by_all, timeout=600, procs=[run.proc], what=f"steps logging {sorted(wanted)}")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{run.text()[-6000:]}") from None
        run.ctrl_c()
    finally:
        run.kill()
    metrics = read_steps(path)
    assert all(m["reward_errors"] == 0 for m in metrics), [m.get("reward_errors") for m in metrics]
    assert all("teacher_kl" in m for m in metrics), [sorted(m) for m in metrics]
    assert re.search(rf"teacher teacher \({re.escape(str(models / 'teacher'))}, hf\) scores every sampled token",
                     run.text()), run.text()[-6000:]  # the block's teacher, loaded from where it names
    assert [m["rewards/my-judge/mean"] for m in metrics if "rewards/my-judge/mean" in m] == \
        [1.0] * sum("rewards/my-judge/mean" in m for m in metrics)  # yes to every question, as built


# ---------------------------------------------------------------------- SFT, then RL


@pytest.mark.slow
def test_sft_then_rl_from_its_checkpoint(checkout, user_env, tmp_path):
    conversations = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                   {"role": "assistant", "content": str(a + b)}]} for a in range(20) for b in range(8)]
    (checkout / "data").mkdir()
    (checkout / "data/conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations))
    sft = Shell(block("ROLLOUTS_CONFIG=configs/sft.toml ./ops/run redis producer trainer").text, cwd=checkout,
                env=user_env, log=tmp_path / "sft.log")
    try:
        assert sft.wait(timeout=900) == 0, sft.text()[-6000:]  # the run ends with the trainer's max_steps
    finally:
        sft.kill()
    assert "trainer: run 'sft'" in sft.text()
    assert (checkout / "runs/sft/checkpoints/step_200/model.safetensors").is_file()

    rl = Shell(block("ROLLOUTS_RUN=rl ROLLOUTS_OUTPUT_DIR=runs/rl ROLLOUTS_MODEL__PATH=runs/sft/checkpoints/step_200 "
                     "./ops/run").text, cwd=checkout, env=user_env, log=tmp_path / "rl.log")
    try:
        rl.wait_for(r"trainer\.1\s+\| step\s+2 \|", timeout=420, what="the RL run's second step")
        rl.ctrl_c()
    finally:
        rl.kill()
    assert "trainer: run 'rl', model runs/sft/checkpoints/step_200" in rl.text(), rl.text()[-4000:]
    assert len(read_steps(checkout / "runs/rl/metrics.jsonl")) >= 2


@pytest.mark.slow  # two runs' producers and trainers, one generator killed and started again (two minutes)
def test_two_runs_train_on_one_generator_killed_and_started_again(checkout, user_env, tmp_path):
    """docs/training.md "Several runs on one generator": both runs train; the generator is SIGKILLed
    while it holds prompts and started again as written; every prompt each run admitted is then
    trained, dropped for a counted reason or pending, and none is trained twice."""
    import psutil

    from common.audit import accounting, trained_twice, unaccounted
    from common.keys import GENERATORS_GROUP
    from common.progress import read_trainer

    for run, key in POOL_RUNS.items():
        (checkout / f"{run}.toml").write_text(config_block(key))
    env = {**user_env, "ROLLOUTS_TRAINER__MAX_STEPS": "3", **CPU_SIZED_POOL}
    r = redis.Redis.from_url(env["ROLLOUTS_REDIS_URL"])
    keys = {run: Keys(run) for run in POOL_RUNS}
    # `wait`: the shell stays, with the processes it started, once the generator is killed
    first = Shell(block(POOL).text + "\nwait", cwd=checkout, env=env, log=tmp_path / "pool.log")
    again = None
    try:
        def stepped(n: int) -> bool:
            try:
                return all(read_trainer(r, k).step >= n for k in keys.values())
            except redis.ConnectionError:  # Redis not up yet
                return False

        wait_for(lambda: stepped(1), timeout=900, what="a step of each run", procs=[first.proc])
        pool = next(p for p in psutil.Process(first.proc.pid).children(recursive=True)
                    if "--runs" in p.cmdline() and "generators" in p.cmdline())
        wait_for(lambda: any(r.xpending_range(k.prompts, GENERATORS_GROUP, "-", "+", 1, consumername="pool")
                             for k in keys.values()), timeout=300, what="the generator holding prompts", poll=0.01)
        pool.kill()  # SIGKILL, holding prompts
        pool.wait(timeout=30)
        held = {run: len(r.xpending_range(k.prompts, GENERATORS_GROUP, "-", "+", 100, consumername="pool"))
                for run, k in keys.items()}
        assert sum(held.values()) > 0, held
        again = Shell(POOL, cwd=checkout, env=env, log=tmp_path / "again.log")
        trainers = [p for p in psutil.Process(first.proc.pid).children(recursive=True)
                    if "trainer" in p.cmdline() and "-m" in p.cmdline()]
        wait_for(lambda: stepped(3), timeout=900, what="both runs' third step", procs=[again.proc])
        psutil.wait_procs(trainers, timeout=120)  # each stops at its max_steps, its last acknowledgements written
        # the producers admit and the generator writes groups on after the trainers stop: SIGKILL
        # them (each write of theirs is one transaction) so the audit's reads, one after another,
        # see one state (a read of `admitted` before an admission and of the stream after it differ)
        producers = [p for p in psutil.Process(first.proc.pid).children(recursive=True)
                     if "producers" in p.cmdline() and "-m" in p.cmdline()]
        again.kill()
        for p in producers:
            p.kill()
        psutil.wait_procs(producers, timeout=30)
        acc = {run: accounting(r, k) for run, k in keys.items()}  # while Redis runs
    finally:
        first.kill()
        if again is not None:
            again.kill()
    said = again.text()
    for run in keys:
        if held[run]:  # taken back by the generator started again under the same id
            assert f"generator pool (run {run}): {held[run]} pending prompts of its own" in said, said[-4000:]
        assert not unaccounted(acc[run]), (run, unaccounted(acc[run]), acc[run])
        assert acc[run]["trained"] >= 3 * 2, (run, acc[run])  # 3 steps of rollout.prompts_per_step 2
        assert trained_twice(checkout / f"runs/{run}/metrics.jsonl") == [], run
        steps = read_steps(checkout / f"runs/{run}/metrics.jsonl")
        assert [s["step"] for s in steps] == [1, 2, 3], (run, steps)


# ---------------------------------------------------------------------- MoE and VLM runs


WATCHER = "readme-test"  # a consumer group of the test's own on a run's samples stream


def watch_groups(redis_url: str, run: str, proc) -> None:
    """Once Redis answers, a consumer group of the test's own on the run's samples stream, from its
    start: the stream is trimmed of what every group has read, so the groups stay for `seen_groups`."""
    r = redis.Redis.from_url(redis_url)

    def watching() -> bool:
        try:
            r.xgroup_create(Keys(run).samples, WATCHER, id="0", mkstream=True)
            return True
        except redis.ConnectionError:  # Redis not up yet
            return False

    wait_for(watching, timeout=300, what="Redis", procs=[proc], poll=0.05)


def seen_groups(redis_url: str, run: str, count: int) -> list:
    """Up to `count` of the run's groups, oldest first, as its generators wrote them (while Redis runs)."""
    from common.keys import PAYLOAD
    from common.messages import decode_group

    r = redis.Redis.from_url(redis_url)
    read = r.xreadgroup(WATCHER, "test", {Keys(run).samples: ">"}, count=count)
    return [decode_group(f[PAYLOAD]) for _, entries in read for _, f in entries]


def two_steps_of(command: str, run: str, *, cwd: Path, env: dict[str, str], log: Path) -> tuple[Shell, list]:
    """`command` (an ./ops/run of the run `run`) until the trainer's second step, then Ctrl-C; the
    finished shell and the run's first groups (up to 4), watched from when Redis answers."""
    shell = Shell(command, cwd=cwd, env=env, log=log)
    try:
        watch_groups(env["ROLLOUTS_REDIS_URL"], run, shell.proc)
        shell.wait_for(r"trainer\.1\s+\| step\s+2 \|", timeout=600, what=f"the {run} run's second step")
        groups = seen_groups(env["ROLLOUTS_REDIS_URL"], run, 4)
        shell.ctrl_c()
    finally:
        shell.kill()
    return shell, groups


@pytest.mark.slow
def test_an_moe_run_with_routing_replay_as_written(checkout, user_env, tmp_path, tiny_model):
    """docs/training.md "Mixture-of-experts models": `rollouts check` on moe.toml prints the mismatch
    with and without routing replay, and ./ops/run trains the MoE, its groups carrying the experts
    that sampled each token (a tiny random Qwen3-MoE in Qwen3-30B-A3B's place)."""
    from tests.harness.models import tiny_moe

    (checkout / "moe.toml").write_text(config_block(MOE))
    env = {**user_env, "ROLLOUTS_MODEL__PATH": str(tiny_moe(tiny_model, tmp_path / "moe"))}
    check = run_once(MOE_CHECK, cwd=checkout, env=env, timeout=600)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    routing = re.search(r"^routing +mean \|log-ratio\| (\S+) with routing replay, (\S+) without .* "
                        r"2 MoE layers, top 2 of 4 experts; generator.routing_replay = on$", check.stdout, re.M)
    assert routing and float(routing[1]) < 1e-3, check.stdout
    run, groups = two_steps_of(block(MOE_RUN).text, "moe", cwd=checkout, env=env, log=tmp_path / "run.log")
    assert "trainer: run 'moe'" in run.text(), run.text()[-4000:]
    assert len(read_steps(checkout / "runs/moe/metrics.jsonl")) >= 2
    assert groups and all(g.routing == (2, 2, 4) for g in groups), [g.routing for g in groups]
    assert all(c.experts is not None and len(c.experts) == len(c.ids) for g in groups for c in g.completions)


@pytest.mark.slow
def test_a_vision_language_run_on_shapes_as_written(checkout, user_env, tmp_path, tiny_model):
    """docs/training.md "Vision-language models": ./ops/run trains a VLM on the shapes task, each
    group carrying its prompt's picture and sampled with it (the mismatch of a run sampling with
    the trainer's own weights), a tiny random Idefics3 in SmolVLM's place."""
    from tests.harness.models import tiny_vlm

    (checkout / "shapes.toml").write_text(config_block(SHAPES))
    env = {**user_env, "ROLLOUTS_MODEL__PATH": str(tiny_vlm(tiny_model, tmp_path / "vlm"))}
    run, groups = two_steps_of(block(SHAPES_RUN).text, "shapes", cwd=checkout, env=env, log=tmp_path / "run.log")
    assert "trainer: run 'shapes'" in run.text(), run.text()[-4000:]
    steps = read_steps(checkout / "runs/shapes/metrics.jsonl")
    fresh = [m["mismatch/by_staleness"]["0"] for m in steps if "0" in m["mismatch/by_staleness"]]
    assert len(steps) >= 2 and fresh and max(fresh) < 1e-3, steps  # sampled by the weights it trains
    assert groups and all(len(g.images) == 1 for g in groups), [len(g.images) for g in groups]


# ---------------------------------------------------------------------- docs/operations.md


def test_the_acl_user_of_operations_md_is_confined_to_its_run(tmp_path):
    import redis

    from tests.harness.servers import start_redis

    port = free_port()
    server = start_redis(tmp_path, port)
    try:
        line = block("text: ACL SETUSER rollouts-demo on >a-long-random-password resetkeys ~rollouts:demo:* ~rq:* "
                     "resetchannels &rq:* +@all -@dangerous +info").text.strip()
        admin = redis.Redis(port=port)
        assert admin.execute_command(*line.split()) in (b"OK", "OK")
        user = redis.Redis(port=port, username="rollouts-demo", password="a-long-random-password")
        user.xadd("rollouts:demo:prompts", {"x": 1})
        user.set("rq:job:1", "x")
        for forbidden in (lambda: user.set("rollouts:other:x", 1), lambda: user.flushall(),
                          lambda: user.config_get("dir")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
    finally:
        server.terminate()
        server.wait(timeout=10)
