"""ops/bench/lora_publish.py's dry run: each way of publishing (full, LoRA merged, LoRA adapter) is
published through the trainer's path and sampled with by the HF engine, the engine's log-probs the
trainer's, and the adapter a small fraction of the merged weights."""

from ops.bench import lora_publish


def test_the_lora_publish_bench_measures_full_merged_and_adapter_versions_the_engine_samples_with(tmp_path,
                                                                                                   tiny_model):
    rows = lora_publish.main(["--dry-run", "--model", str(tiny_model), "--repeat", "2", "--rank", "4",
                              "--threads", "1", "--work-dir", str(tmp_path)])
    by_mode = {r.mode: r for r in rows}
    assert [(r.engine, r.mode) for r in rows] == [("hf", m) for m in ("full", "lora merged", "lora adapter")]
    full, merged, adapter = by_mode["full"], by_mode["lora merged"], by_mode["lora adapter"]
    assert all(len(r.versions) == 2 for r in rows)
    # Merged LoRA publishes what full fine-tuning does (the base model's names and shapes); the adapter
    # alone is a small fraction of it, while LoRA trains a small fraction of the weights.
    assert merged.versions[0].bytes == full.versions[0].bytes
    sizes = adapter.versions[0].bytes, merged.versions[0].bytes
    assert sizes[0] * 4 < sizes[1], sizes
    assert adapter.trainable == merged.trainable and merged.trainable * 4 < full.trainable
    for r in rows:
        for v in r.versions:
            assert v.publish > 0 and v.load > 0 and v.sample > 0 and v.again > 0 and v.to_sample >= v.sample
    table = lora_publish.table(rows)
    assert table.count("\n| hf |") == 3 and "| lora adapter |" in table
