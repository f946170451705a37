# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""GPU: HybridDeviceOptimizer under Megatron's DistributedOptimizer and DDP, resumed.

World size 1 in-process (NCCL), bf16 model, precision-aware CPU offload as Megatron-LM
configures it. Each checkpoint path trains, saves, goes on uninterrupted, and is compared
bit for bit with a fresh model and optimizer that load the checkpoint and take the same
steps. Pinned host memory after the load must not exceed the resumed run's cold start.
"""

import os

import pytest
import torch

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

fixture_parallel_state = optimizer_table.sibling("single_rank").fixture_parallel_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN = 64
STEPS_BEFORE_SAVE = 3
STEPS_AFTER_SAVE = 3


def _pinned_bytes():
    return torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)


def build(fraction, seed, precision_aware=True, hidden=HIDDEN, overlap=False, **config_fields):
    """A DDP-wrapped bf16 model and its offloading distributed optimizer.

    Args:
        overlap: DDP overlaps its gradient reduce-scatter and parameter all-gather (Megatron-LM's
            ``--overlap-grad-reduce --overlap-param-gather``).
        config_fields: set on the ``OptimizerConfig`` before the factory reads it (fields
            megatron-core's dataclass may not declare).
    """
    # pylint: disable=import-outside-toplevel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    class TinyModel(MegatronModule):
        """Four linear layers: several params per bucket and several buckets."""

        def __init__(self, config):
            super().__init__(config)
            self.layers = torch.nn.Sequential(
                torch.nn.Linear(hidden, 2 * hidden),
                torch.nn.GELU(),
                torch.nn.Linear(2 * hidden, hidden),
                torch.nn.GELU(),
                torch.nn.Linear(hidden, hidden),
                torch.nn.Linear(hidden, hidden, bias=False),
            )

        def forward(self, x):  # pylint: disable=missing-function-docstring
            return self.layers(x)

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    module = TinyModel(config).cuda().to(torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        bucket_size=max(8192, hidden * hidden),
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
    )
    model = DistributedDataParallel(config, ddp_config, module)
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.01,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=fraction,
        use_precision_aware_optimizer=precision_aware,
        clip_grad=1.0,
    )
    for name, value in config_fields.items():
        setattr(optimizer_config, name, value)
    return model, get_megatron_optimizer(optimizer_config, [model])


def batches(count, seed, hidden=HIDDEN):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(16, hidden, generator=generator, device="cuda", dtype=torch.bfloat16)
        for _ in range(count)
    ]


def train(model, optimizer, data):
    for batch in data:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def save_legacy(model, optimizer, folder):
    path = os.path.join(folder, "param_state.pt")
    optimizer.save_parameter_state(path)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path + ".common")
    return path


def load_legacy(model, optimizer, path):
    common = torch.load(path + ".common", weights_only=False)
    model.load_state_dict(common["model"])
    optimizer.load_state_dict(common["optimizer"])
    optimizer.load_parameter_state(path)


def save_dist(model, optimizer, folder, sharding_type):
    from megatron.core import dist_checkpointing  # pylint: disable=import-outside-toplevel

    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding_type}
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata),
    }
    dist_checkpointing.save(state, folder)
    return folder


def load_dist(model, optimizer, folder, sharding_type):
    from megatron.core import dist_checkpointing  # pylint: disable=import-outside-toplevel

    # Upstream 0.19.2's DistributedOptimizer needs materialised state to describe itself
    # when neither TE nor Apex is installed (its state_dict reads a step from every
    # state entry); the HDO's dummy_step is the materialiser it uses itself.
    for distributed in optimizer.chained_optimizers:
        if not distributed.optimizer.state:
            distributed.optimizer.dummy_step()
    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding_type}
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata),
    }
    loaded = dist_checkpointing.load(state, folder)
    # The DDP wrapper names its sharded keys with a "module." prefix it does not load with.
    model.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()})
    optimizer.load_state_dict(loaded["optimizer"])


# fully_sharded_model_space is left out: 0.19.2's dist_checkpointing refuses its
# flattened ShardedTensors for any inner optimizer.
FORMATS = optimizer_table.checkpoint_formats("legacy", "dp_reshardable", "fully_reshardable")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_resume_under_the_distributed_optimizer_is_exact(parallel_state, tmp_path, fraction, fmt):
    # pylint: disable=redefined-outer-name,unused-argument
    from megatron.core.optimizer.cpu_offloading import (  # pylint: disable=import-outside-toplevel
        HybridDeviceOptimizer,
    )

    model, optimizer = build(fraction, seed=1)
    assert isinstance(optimizer.chained_optimizers[0].optimizer, HybridDeviceOptimizer)
    train(model, optimizer, batches(STEPS_BEFORE_SAVE, seed=2))
    folder = str(tmp_path)
    if fmt == "legacy":
        save_legacy(model, optimizer, folder)
    else:
        save_dist(model, optimizer, folder, fmt)
    follow_up = batches(STEPS_AFTER_SAVE, seed=3)
    train(model, optimizer, follow_up)
    expected = params_of(model)
    del model, optimizer

    resumed_model, resumed = build(fraction, seed=11)
    cold_start = _pinned_bytes()
    if fmt == "legacy":
        load_legacy(resumed_model, resumed, os.path.join(folder, "param_state.pt"))
    else:
        load_dist(resumed_model, resumed, folder, fmt)
    after_load = _pinned_bytes()
    assert after_load <= cold_start, (cold_start, after_load)
    train(resumed_model, resumed, follow_up)
    actual = params_of(resumed_model)
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a, e), f"param {index}: max diff {(a.float() - e.float()).abs().max()}"
