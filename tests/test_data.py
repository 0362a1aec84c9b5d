"""Prompt sources: data set files of every local format, column mapping, bad rows, mixtures and
exact resume of the dataset position."""

import json
import signal
import tomllib
from collections import Counter

import pytest
from datasets import Dataset, DatasetDict

from common.config import ConfigError, DatasetSource, config_from_dict, source_config
from common.keys import PAYLOAD, Keys
from common.messages import decode_prompt
from common.progress import read_producer, write_step
from producers.data import DataError, Source, choose
from producers.main import admit, load_positions
from tasks import arithmetic, countdown
from tests.harness.processes import spawn, stop, wait_for

QUESTIONS = Dataset.from_dict({"question": [f"What is {i} + {i}?" for i in range(6)],
                               "answer": [2 * i for i in range(6)]})


def dataset_source(path, **fields) -> DatasetSource:
    return source_config(**{"name": "qa", "kind": "dataset", "path": str(path), "prompt_column": "question",
                           "answer_column": "answer", **fields})


def take(source: Source, count: int):
    return [source.take() for _ in range(count)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv", "arrow", "disk", "disk_dict"])
def test_each_local_format_loads_into_prompts(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        QUESTIONS.to_json(path, lines=True)
    elif fmt == "parquet":
        QUESTIONS.to_parquet(path)
    elif fmt == "csv":
        QUESTIONS.to_csv(path, index=False)
    elif fmt == "arrow":  # a directory of .arrow files, as `datasets` writes them
        QUESTIONS.save_to_disk(tmp_path / "saved")
        path = next((tmp_path / "saved").glob("*.arrow"))
    elif fmt == "disk":
        QUESTIONS.save_to_disk(path)
    else:
        DatasetDict({"train": QUESTIONS, "test": QUESTIONS.select([0])}).save_to_disk(path)
    source = Source(dataset_source(path, shuffle=False), seed=0, field="data.sources.0")
    prompts = take(source, 6)
    assert [p.id for p in prompts] == [f"qa:0:{i}" for i in range(6)]
    assert prompts[4].messages == [{"role": "user", "content": "What is 4 + 4?"}]
    assert str(prompts[4].meta["answer"]) == "8" and prompts[4].meta["source"] == "qa"
    assert (source.epoch, source.offset) == (1, 0)  # six rows: one epoch


def test_gsm8k_style_jsonl_extracts_the_final_answer_and_applies_the_template(tmp_path):
    rows = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "A car costs $1,200 and a bike $34. Together?", "answer": "1200+34\n#### 1,234"}]
    path = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    config = source_config(name="gsm8k", path=str(path), template="{question}\nAnswer with just the number.",
                          answer_column="answer", answer_extractor="gsm8k", system_prompt="Be brief.",
                          shuffle=False)
    first, second = take(Source(config, seed=0, field="data.sources.0"), 2)
    assert first.messages == [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": rows[0]["question"] + "\nAnswer with just the number."}]
    assert first.meta == {"source": "gsm8k", "answer": "7"}
    assert second.meta["answer"] == "1234"


def test_messages_column_and_plain_text_prompts(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi?"}], "label": "hello"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    chat = Source(source_config(name="c", path=str(path), messages_column="messages", answer_column="label",
                               system_prompt="S."), seed=0, field="f").take()
    assert chat.messages == [{"role": "system", "content": "S."}, {"role": "user", "content": "Hi?"}]
    text = Source(dataset_source(write_jsonl(tmp_path / "q.jsonl", [{"question": "Q?", "answer": 1}]),
                                 chat=False, system_prompt="S."), seed=0, field="f").take()
    assert text.messages is None and text.text == "S.\n\nQ?"


def test_streaming_reads_epochs_and_resumes_at_its_offset(tmp_path):
    path = tmp_path / "data.jsonl"
    QUESTIONS.to_json(path, lines=True)
    config = dataset_source(path, streaming=True, shuffle_buffer=4)
    straight = [p.id for p in take(Source(config, seed=3, field="f"), 15)]
    assert Counter(i.rsplit(":", 2)[1] for i in straight) == {"0": 6, "1": 6, "2": 3}
    source = Source(config, seed=3, field="f")
    head = take(source, 8)
    resumed = Source(config, seed=3, field="f", epoch=source.epoch, offset=source.offset)
    assert [p.id for p in head + take(resumed, 7)] == straight
    assert sorted(p.meta["answer"] for p in head[:6]) == list(QUESTIONS["answer"])


# ---------------------------------------------------------------------- start-up checks


def test_a_missing_column_fails_at_start_up_listing_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "Q?", "answer": 1}])
    with pytest.raises(DataError) as err:
        Source(dataset_source(path, answer_column="solution"), seed=0, field="data.sources.0")
    assert "data.sources.0.answer_column" in str(err.value)
    assert "'solution'" in str(err.value) and "['question', 'answer']" in str(err.value)
    with pytest.raises(DataError, match=r"data.sources.0.template: column 'query'"):
        Source(dataset_source(path, template="{query}?"), seed=0, field="data.sources.0")
    with pytest.raises(DataError, match=r"data.sources.0.path: .* does not exist"):
        Source(dataset_source(tmp_path / "nope.jsonl"), seed=0, field="data.sources.0")


def test_the_producer_refuses_a_missing_column_at_start_up(tmp_path, redis_url):
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "Q?", "answer": 1}])
    (tmp_path / "run.toml").write_text(f"""
[[data.sources]]
name = "mine"
path = "{data}"
prompt_column = "prompt"
""")
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_CONFIG": str(tmp_path / "run.toml")}
    proc = spawn("producers", cwd=tmp_path, env=env, log=tmp_path / "producer.log")
    assert proc.wait(timeout=60) != 0
    log = (tmp_path / "producer.log").read_text()
    assert "data.sources.0.prompt_column" in log and "['question', 'answer']" in log, log


def test_a_source_takes_only_the_fields_of_its_kind():
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.path: unknown field for kind 'countdown'"):
        config_from_dict({"data": {"sources": [{"name": "a", "kind": "countdown", "path": "x.jsonl"}]}})
    with pytest.raises(ConfigError, match=r"data\.sources\.1\.max_length: unknown field for kind 'dataset'"):
        config_from_dict({"data": {"sources": [{"name": "a", "kind": "arithmetic"},
                                               {"name": "b", "path": "x.jsonl", "prompt_column": "q",
                                                "max_length": 9}]}})
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.kind: unknown kind 'nope'; expected one of .*'reverse'"):
        config_from_dict({"data": {"sources": [{"name": "a", "kind": "nope"}]}})
    config = config_from_dict({"data": {"sources": [{"name": "a", "path": "x.jsonl", "prompt_column": "q"}]}})
    assert config.sources[0].kind == "dataset"  # a table that names no kind is a data set


def test_source_config_errors_name_the_dotted_field():
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.path"):
        config_from_dict({"data": {"sources": [{"name": "a", "prompt_column": "q"}]}})
    with pytest.raises(ConfigError, match=r"data\.sources\.1\.prompt_column"):
        config_from_dict({"data": {"sources": [{"name": "a", "kind": "countdown"},
                                               {"name": "b", "path": "x.jsonl"}]}})
    with pytest.raises(ConfigError, match=r"data\.sources: names must be unique"):
        config_from_dict({"data": {"sources": [{"name": "a", "kind": "countdown"},
                                               {"name": "a", "kind": "arithmetic"}]}})
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.reward"):
        config_from_dict({"data": {"sources": [{"name": "a", "kind": "countdown", "reward": "os.system"}]}})


# ---------------------------------------------------------------------- bad rows


def test_bad_rows_are_skipped_counted_and_named(tmp_path, r):
    rows = [{"question": "Good 0?", "answer": "#### 1"},
            {"question": None, "answer": "#### 2"},  # missing value
            {"question": "   ", "answer": "#### 3"},  # empty text
            {"question": 17, "answer": "#### 4"},  # wrong type
            {"question": "No final answer?", "answer": "5"},  # extractor finds nothing
            {"question": "Good 5?", "answer": "#### 6"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    config = dataset_source(path, answer_extractor="gsm8k", shuffle=False)
    keys = Keys("bad")
    load_positions(r, keys, seed=0, names=["qa"])
    skipped = admit(r, keys, sources=[Source(config, seed=0, field="f")], weights=[1.0], seed=0,
                    admitted=0, count=3, n=2, version=0)
    ids = [decode_prompt(f[PAYLOAD]).id for _, f in r.xrange(keys.prompts)]
    assert ids == ["qa:0:0", "qa:0:5", "qa:1:0"]  # the run goes on, into the next epoch
    assert [row.id for _, row in skipped] == ["qa:0:1", "qa:0:2", "qa:0:3", "qa:0:4"]
    assert "'question' is a NoneType" in skipped[0][1].reason
    assert "empty" in skipped[1][1].reason and "int" in skipped[2][1].reason
    assert "####" in skipped[3][1].reason
    assert read_producer(r, keys).rows_skipped == 4
    assert read_producer(r, keys).sources["qa"].rows_skipped == 4
    assert read_producer(r, keys).last_skipped.startswith("qa:0:4")


# ---------------------------------------------------------------------- mixtures


def test_a_two_source_mixture_is_admitted_in_its_configured_proportion(r):
    keys = Keys("mix")
    configs = [source_config(name="arith", kind="arithmetic", weight=3.0),
               source_config(name="count", kind="countdown", weight=1.0)]
    sources = [Source(c, seed=0, field="f") for c in configs]
    load_positions(r, keys, seed=0, names=["arith", "count"])
    for admitted in range(0, 2000, 64):
        admit(r, keys, sources=sources, weights=[3.0, 1.0], seed=0, admitted=admitted,
              count=min(64, 2000 - admitted), n=2, version=0)
    tasks = [decode_prompt(f[PAYLOAD]) for _, f in r.xrange(keys.prompts)]
    share = sum(t.meta["source"] == "arith" for t in tasks) / len(tasks)
    # 2000 draws at p = 0.75: one standard deviation is 0.0097; allow three.
    assert len(tasks) == 2000 and abs(share - 0.75) < 0.03, share
    assert all(t.id.startswith(t.meta["source"] + ":") for t in tasks)
    count_ids = [t.id for t in tasks if t.meta["source"] == "count"]
    assert count_ids == [f"count:0:{i}" for i in range(len(count_ids))]  # no gap within a source
    assert read_producer(r, keys).sources["count"].offset == len(count_ids)
    # each prompt's source is the draw of (seed, index) alone, so a restarted producer draws the same
    assert [t.meta["source"] for t in tasks] == \
        [["arith", "count"][choose(seed=0, index=i, weights=[3.0, 1.0])] for i in range(2000)]


# ---------------------------------------------------------------------- exact resume


def admitted_ids(r, keys):
    return [decode_prompt(f[PAYLOAD]).id for _, f in r.xrange(keys.prompts)]


def test_producer_killed_mid_epoch_resumes_the_exact_sequence(tmp_path, redis_url, r):
    data = tmp_path / "seven.jsonl"
    QUESTIONS.select(range(5)).to_json(data, lines=True)  # a small epoch, so the run crosses two
    (tmp_path / "run.toml").write_text(f"""
[rollout]
prompts_per_step = 3
max_staleness = 0

[[data.sources]]
name = "qa"
path = "{data}"
prompt_column = "question"
answer_column = "answer"
weight = 2.0

[[data.sources]]
name = "arithmetic"
kind = "arithmetic"
""")

    def producer(run: str):
        env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": run, "ROLLOUTS_CONFIG": str(tmp_path / "run.toml"),
               "ROLLOUTS_TASK__SEED": "7"}
        return spawn("producers", cwd=tmp_path, env=env, log=tmp_path / f"{run}.log")

    # ---- killed: 3 prompts at version 0, 9 at version 2, SIGKILL, then on to 18 at version 5
    killed = Keys("killed")
    proc = producer("killed")
    try:
        wait_for(lambda: r.xlen(killed.prompts) == 3, timeout=60, what="3 prompts", procs=[proc])
        write_step(r, killed, step=2, version=2)
        wait_for(lambda: r.xlen(killed.prompts) == 9, timeout=30, what="9 prompts", procs=[proc])
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        at = read_producer(r, killed).sources["qa"]
        assert at.epoch >= 1 or at.offset > 0, "killed before any qa row"
        write_step(r, killed, step=5, version=5)
        proc = producer("killed")
        wait_for(lambda: r.xlen(killed.prompts) == 18, timeout=60, what="18 prompts", procs=[proc])
    finally:
        assert stop(proc) == 0, (tmp_path / "killed.log").read_text()

    # ---- never killed: straight to version 5
    straight = Keys("straight")
    write_step(r, straight, step=5, version=5)
    proc = producer("straight")
    try:
        wait_for(lambda: r.xlen(straight.prompts) == 18, timeout=60, what="18 prompts", procs=[proc])
    finally:
        assert stop(proc) == 0, (tmp_path / "straight.log").read_text()

    ids = admitted_ids(r, killed)
    assert ids == admitted_ids(r, straight)
    assert len(set(ids)) == 18, "a prompt was admitted twice"
    qa = [i for i in ids if i.startswith("qa:")]
    epochs = [[int(i.split(":")[2]) for i in qa if i.split(":")[1] == e] for e in ("0", "1")]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(5)), qa  # whole epochs, no gap
    assert epochs[0] != epochs[1], "the second epoch was not reshuffled"
    assert read_producer(r, killed).admitted == 18


# ---------------------------------------------------------------------- built-in builders


def test_builtin_tasks_ship_as_dataset_builders(tmp_path):
    ds = countdown.dataset(size=20, seed=1)
    assert ds.column_names == ["question", "numbers", "target"] and len(ds) == 20
    assert ds[3]["target"] == countdown.problem(seed=1, index=3, numbers=4, max_number=25).target
    ar = arithmetic.dataset(size=5, ops=["*"])
    assert ar[0]["answer"] == arithmetic.problem(seed=0, index=0, max_operand=20, ops=["*"]).answer
    ds.to_json(tmp_path / "cd.jsonl", lines=True)
    config = source_config(name="cd", path=str(tmp_path / "cd.jsonl"), prompt_column="question",
                          meta_columns=["numbers", "target"], reward="tasks.countdown:reward")
    prompt = Source(config, seed=0, field="f").take()
    assert set(prompt.meta) == {"source", "numbers", "target"}


def test_the_readme_own_data_example_works(tmp_path, monkeypatch):
    from tests.harness.processes import ROOT

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Bring your own model, data and reward", 1)[1]
    toml = section.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", [{"question": "Tom has 3 apples and buys 4?",
                                                     "answer": "3 + 4 = 7\n#### 7"}])
    monkeypatch.chdir(tmp_path)
    config = config_from_dict(tomllib.loads(toml))
    (source_config,) = config.sources
    prompt = Source(source_config, seed=0, field="data.sources.0").take()
    assert prompt.id == "mine:0:0" and prompt.meta == {"source": "mine", "answer": "7"}
    assert prompt.messages[-1]["content"] == "Tom has 3 apples and buys 4?\nAnswer with just the number."
    assert source_config.reward_name == "tasks.gsm8k:reward"


# ---------------------------------------------------------------------- SFT data


def test_a_conversation_becomes_an_sft_group_trained_on_assistant_turns(tiny_model):
    from transformers import AutoTokenizer

    from common.messages import decode_group, encode
    from producers.sft import conversation_group

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
                {"role": "assistant", "content": "6"}, {"role": "user", "content": "Thanks"}]
    group = decode_group(encode(conversation_group(tokenizer, messages, group_id="chat:0:0")))
    (c,) = group.completions
    trained = tokenizer.decode([i for i, m in zip(c.ids, c.loss_mask, strict=True) if m])
    untrained = tokenizer.decode([i for i, m in zip(c.ids, c.loss_mask, strict=True) if not m])
    assert tokenizer.decode(group.prompt_ids).endswith("What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert trained.replace(" ", "") == "4<|im_end|>\n6<|im_end|>\n".replace(" ", "")
    assert "And 3 + 3?" in untrained and "Thanks" not in c.text  # the trailing user turn is dropped
    assert tokenizer.decode([*group.prompt_ids.tolist(), *c.ids.tolist()]) == tokenizer.apply_chat_template(
        messages[:5], tokenize=False)
