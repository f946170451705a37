# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""GPU: a dist-checkpoint resume never needs more GPU memory than the optimizer state itself.

A DDP model with the optimizer megatron-core builds (TE FusedAdam with fp32 moments, the
precision-aware optimizer with bf16 or fp16 moments, or the HybridDeviceOptimizer with
offloaded state) trains, saves a dist checkpoint, and a fresh model and optimizer load it.
Around each phase of the load (the ``is_loading`` sharded state dict, the read, the
``load_state_dict``) the peak of GPU memory above the memory allocated before the load must
stay within the state the load must create anyway (everything the inner optimizer keeps
per parameter on the GPU) plus ``TOLERANCE`` state sets (exp_avg + exp_avg_sq in their
stored dtype). Offloaded state keeps the GPU figures at zero, within ``OFFLOADED_SLACK``.

Transformer Engine rows skip where TE does not import; everything skips without CUDA.
"""

from types import SimpleNamespace

import pytest
import torch

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

import_harness = optimizer_table.sibling("fork_tools").import_harness
fixture_parallel_state = optimizer_table.sibling("single_rank").fixture_parallel_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

tool = import_harness()

TOLERANCE = 0.05
"""State sets a phase may add on top of the state itself: small tensors, allocator rounding."""
OFFLOADED_SLACK = 2**20
"""Bytes a phase may add when no state lives on the GPU (step counters, tiny buffers)."""

SHAPE = tool.Shape(hidden=1024, ffn=2048)  # 6.3M parameters: state sets of 25-50 MiB
CASES = [
    "fp32-off0-dp_reshardable-fused_adam",
    "bf16-off0-dp_reshardable-fused_adam",
    "bf16-off0-dp_zero_gather_scatter-fused_adam",
    "fp32-off0-fully_reshardable-fused_adam",
    "bf16-off0-dp_reshardable-precision_aware_remainders",
    "bf16-off0-fully_reshardable-precision_aware_remainders",
    "bf16-off0-dp_reshardable-precision_aware",
    "bf16-off0-dp_reshardable-precision_aware_fp16",
    "bf16-off0.5-dp_reshardable",
    "bf16-off1-dp_reshardable",
]


@pytest.fixture(name="rank", scope="module")
def fixture_rank(parallel_state):  # pylint: disable=unused-argument
    """Rank 0 of the one-rank world, as the harness's save step takes it."""
    return SimpleNamespace(rank=0, barrier=torch.distributed.barrier)


def _needs_gradients_for_state(optimizer):
    """Whether an optimizer stepping GPU parameters creates its state only by null steps with
    gradients: TE FusedAdam creates it for every parameter it visits, and torch's Adam and
    AdamW have theirs allocated directly; any other optimizer needs them."""
    try:  # the fork's contract; upstream 0.19.2 has none
        from megatron.core.optimizer.optimizer_state_creation import STATE_BY_EXAMPLE as direct
    except ImportError:
        direct = ()
    for dist in tool.distributed_optimizers(optimizer):
        for sub in getattr(dist.optimizer, "sub_optimizers", [dist.optimizer]):
            on_gpu = any(p.is_cuda for g in sub.param_groups for p in g["params"])
            te = type(sub).__module__.startswith("transformer_engine.")
            if on_gpu and not te and type(sub) not in direct:
                return True
    return False


def _largest_piece_bytes(optimizer):
    return max(
        (
            t.numel() * 4
            for dist in tool.distributed_optimizers(optimizer)
            for entry in dist.optimizer.state.values()
            for t in entry.values()
            if isinstance(t, torch.Tensor) and t.is_cuda
        ),
        default=0,
    )


@pytest.mark.parametrize("name", CASES)
def test_each_load_phase_peaks_at_the_state_itself(name, rank, tmp_path):
    case = tool.Case.parse(name)
    reason = tool.te_unavailable(case)
    if reason:
        pytest.skip(reason)
    model, optimizer = tool.build(case, tool.SAVE_SEED, SHAPE)
    tool.train(model, optimizer, case, tool.TRAIN_STREAM, 2, rank.rank, SHAPE)
    tool.save_checkpoint(case, model, optimizer, tmp_path, rank)
    del model, optimizer

    model, optimizer = tool.build(case, tool.LOAD_SEED, SHAPE)
    tool._release()  # pylint: disable=protected-access
    peaks = tool.PhasePeaks()
    tool.load_checkpoint(case, model, optimizer, tmp_path, peaks)
    state = tool.optimizer_state_bytes(optimizer)
    if state["gpu_all"] == 0:
        bound = OFFLOADED_SLACK
    else:
        bound = state["gpu_all"] + TOLERANCE * state["gpu_moments"]
        if _needs_gradients_for_state(optimizer):
            # Its null steps run over a bounded share of the elements, but never less than one
            # parameter: the largest piece's zero gradient and the step's temporary of its size.
            bound += 2 * _largest_piece_bytes(optimizer)
    over = {phase: peak for phase, peak in peaks.peaks.items() if peak > bound}
    assert not over, (
        f"phases over {bound / 2**20:.1f} MiB (state {state['gpu_all'] / 2**20:.1f} MiB, "
        f"a state set {state['gpu_moments'] / 2**20:.1f} MiB): "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in over.items())
    )
    # The second pass allocates nothing that stays.
    slack = TOLERANCE * state["gpu_moments"] or OFFLOADED_SLACK
    assert peaks.after["load_state_dict"] <= peaks.after["read"] + slack
