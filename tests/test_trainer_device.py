"""The trainer keeps every tensor of a step on the model's device, and its collectives on the
process group's: checked without a GPU by a dry run on the `meta` device. A tensor left on the CPU
makes many ops raise "... is not on the expected device meta", but not all (an embedding looks up
CPU ids in meta weights without a word, where CUDA refuses), so every op is watched: none may mix
the model's device with another, as CUDA would refuse (a 0-dim CPU tensor, a scalar, is allowed
there too). Tensors built on the host and then moved are fine; an op computing on both is not."""

import random
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from common.config import GrpoLoss
from tests.harness.groups import make_group
from trainer.devices import backend_device
from trainer.parallel import all_max, all_sum, any_rank, collective_device
from trainer.step import GrpoOptions, sft_step, step_batches, train_step

ROOT = Path(__file__).resolve().parents[1]

# What reads a value back to Python; on meta there is none, so the dry run reads 0.
# (`bool` is True: transformers asks "is there no padding?" and then takes its unmasked path.)
READS = {torch.Tensor.item: 0.0, torch.Tensor.__float__: 0.0, torch.Tensor.__int__: 0, torch.Tensor.__bool__: True,
         torch.Tensor.tolist: None}


class ReadsOffMetaAreZero(TorchFunctionMode):
    """Lets a step run to its end on the meta device: `.item()` and friends of a meta tensor give 0
    (the step's numbers are meaningless; which device each op sees is what is checked)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return READS[func] if func is not torch.Tensor.tolist else [0.0] * args[0].numel()
        return func(*args, **(kwargs or {}))


class MixedDevices(TorchDispatchMode):
    """Every op called with a tensor on the meta device and another elsewhere (but a 0-dim CPU
    scalar), as (op, device, shape) of the other; and how many ops computed on meta at all."""

    def __init__(self):
        super().__init__()
        self.mixed: list[tuple[str, str, tuple[int, ...]]] = []
        self.on_meta = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in tensors):
            self.on_meta += 1
            self.mixed += [(str(func), str(t.device), tuple(t.shape)) for t in tensors
                           if not t.is_meta and not (t.device.type == "cpu" and t.dim() == 0)]
        return func(*args, **(kwargs or {}))


def assert_stepped_on_meta(model, opt, watch: MixedDevices) -> None:
    """The step ran on the model's device end to end: no op mixed devices, and the optimizer
    updated every parameter, its moments on meta beside them."""
    assert not watch.mixed, f"ops given tensors off the model's device: {sorted(set(watch.mixed))[:10]}"
    assert all(p.is_meta for p in model.parameters()), "the step moved the model off its device"
    params = list(model.parameters())
    assert len(opt.state) == len(params) and all(opt.state[p]["exp_avg"].is_meta for p in params), \
        "the optimizer did not step every parameter on the model's device"


@pytest.fixture
def meta_run(tiny_model):
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(3)
    groups = [make_group(base, f"g{i}", version=0, rng=rng) for i in range(2)]

    def on_meta():
        return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).to("meta")

    return groups, on_meta


def test_a_grpo_step_builds_every_tensor_on_the_models_device(meta_run):
    """Every path of train_step at once: the no-grad proximal pass (decoupled PPO), two PPO
    mini-batches, the frozen reference (KL), TIS, the sampler's top-k/top-p truncation, micro-batches
    and the entropy."""
    groups, on_meta = meta_run
    model, ref = on_meta(), on_meta().eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ReadsOffMetaAreZero(), MixedDevices() as watch:
        train_step(model, opt, groups, ref_model=ref, step=1, how=GrpoOptions(
            loss=GrpoLoss(correction={"type": "decoupled", "tis_cap": 2.0}, kl_coef=0.1), temperature=0.7, top_k=4,
            top_p=0.9, estimator="grpo", overlong="none", overlong_penalty=0.0, micro_batch_size=4,
            micro_batch_tokens=0, updates=2, max_grad_norm=1.0))
    assert_stepped_on_meta(model, opt, watch)


def test_an_sft_step_builds_every_tensor_on_the_models_device(meta_run):
    """The SFT step end to end (forward over every micro-batch, backward, clipping, AdamW) on meta:
    no op mixes devices, every loss-masked token is trained, every parameter updated."""
    groups, on_meta = meta_run
    model = on_meta()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ReadsOffMetaAreZero(), MixedDevices() as watch:
        stats = sft_step(model, opt, groups, micro_batch_size=4, micro_batch_tokens=0, max_grad_norm=1.0)
    trained = sum(len(c.ids) if c.loss_mask is None else int(sum(c.loss_mask)) for g in groups for c in g.completions)
    assert stats.tokens_trained == trained > 0, (stats, trained)
    assert watch.on_meta > 0 and stats.skipped == 0, (watch.on_meta, stats)
    assert_stepped_on_meta(model, opt, watch)


class CollectiveDevices(TorchDispatchMode):
    """The devices of the tensors each c10d collective is called with."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.device]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self.seen.append((func.__name__, t.device))
        return func(*args, **(kwargs or {}))


def test_collectives_run_on_the_process_groups_device(tmp_path):
    assert backend_device("nccl") == torch.device("cuda"), "NCCL takes CUDA tensors only"
    assert backend_device("gloo") == torch.device("cpu")
    # an in-process vLLM engine of an earlier test may have made this process's group already (gloo, one rank)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with CollectiveDevices() as watch:
            assert all_sum([1.5, 2.0]) == [1.5, 2.0]
            assert all_max(3) == 3
            assert any_rank(True)
        assert len(watch.seen) >= 3, watch.seen
        assert {device for _, device in watch.seen} == {collective_device()} == {torch.device("cpu")}, watch.seen
    finally:
        if own:
            dist.destroy_process_group()


class CountedReads(ReadsOffMetaAreZero):
    """`ReadsOffMetaAreZero`, and where each read of a meta tensor came from (the innermost line of
    this repository that led to it)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            ours = [f for f in traceback.extract_stack()[:-1] if str(ROOT) in f.filename and "/tests/" not in f.filename
                    and "/.venv/" not in f.filename]
            self.reads.append(f"{Path(ours[-1].filename).relative_to(ROOT)}:{ours[-1].lineno}" if ours else "?")
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("objective", ["grpo", "sft"])
def test_a_step_reads_the_device_back_once_an_update_and_once_at_its_end_whatever_its_micro_batches(meta_run,
                                                                                                   objective):
    """On a GPU a read of a device value waits for every kernel queued before it: a read per
    micro-batch would leave the GPU idle while the host reads and queues the next pass. The step
    reads back the update's losses and gradient norm (to skip a non-finite update) and, at its
    end, the statistics of every pass at once (sft's come with its update's losses): as many reads
    with one completion a micro-batch as with all of them in one."""
    groups, on_meta = meta_run
    updates = 2 if objective == "grpo" else 1
    reads, micro_batches = {}, {}
    for size in (1, 8):
        model, ref = on_meta(), on_meta().eval().requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with CountedReads() as counted:
            if objective == "grpo":
                stats = train_step(model, opt, groups, ref_model=ref, step=1, how=GrpoOptions(
                    loss=GrpoLoss(correction={"type": "decoupled", "tis_cap": 2.0}, kl_coef=0.1), temperature=0.7,
                    top_k=4, top_p=0.9, estimator="grpo", overlong="none", overlong_penalty=0.0,
                    micro_batch_size=size, micro_batch_tokens=0, updates=updates, max_grad_norm=1.0))
            else:
                stats = sft_step(model, opt, groups, micro_batch_size=size, micro_batch_tokens=0, max_grad_norm=1.0)
        assert stats.skipped == 0, stats
        reads[size] = sorted(counted.reads)
        micro_batches[size] = sum(len(m.batches) for m in step_batches(
            groups, micro_batch_size=size, micro_batch_tokens=0, parts=updates, objective=objective))
    assert micro_batches[1] > micro_batches[8], micro_batches
    assert reads[1] == reads[8], f"reads with {micro_batches} micro-batches: {reads}"
    # each update's losses (read_back) and gradient norm (clip_and_step); the GRPO step's statistics at its end
    assert len(reads[8]) == 2 * updates + (objective == "grpo"), reads[8]
