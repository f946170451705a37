# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""GPU + genuine Transformer Engine: the FusedAdam load fast path against TE's own loader.

Each mode builds two identical TE FusedAdam optimizers, trains a source optimizer, and loads
its state dict into one through ``load_fused_adam_state_dict`` and into the other through
TE's ``load_state_dict``. The fast path must keep the incoming tensors (fp32) or hold each
state once (precision-aware), allocate no more than TE's loader does during the load, and
leave both optimizers taking bit-identical steps afterwards.
"""

import copy
import gc

import pytest
import torch

te_optimizers = pytest.importorskip("transformer_engine.pytorch.optimizers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from megatron.core.optimizer import (
    fused_adam_state_load as fsl,  # pylint: disable=wrong-import-position
)

SHAPES = [(256, 128), (1024,), (64, 64)]

MASTER_OPTIONS = dict(master_weights=True, use_decoupled_grad=True)


def moments_in(dtype):
    """Precision-aware FusedAdam keeping both moments in ``dtype`` beside an fp32 master."""
    return (
        torch.bfloat16,
        dict(MASTER_OPTIONS, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype),
        "materialise",
    )


# mode -> (parameter dtype, FusedAdam options, plan the fast path must choose)
MODES = {
    "fp32": (torch.float32, {}, "adopt"),
    "bf16_moments_master": moments_in(torch.bfloat16),
    "fp16_moments_master": moments_in(torch.float16),
    "param_remainders": (
        torch.bfloat16,
        dict(MASTER_OPTIONS, store_param_remainders=True),
        "materialise",
    ),
}


def make(mode, seed=0):
    dtype, options, _ = MODES[mode]
    generator = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to("cuda", dtype))
        for shape in SHAPES
    ]
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]
    optimizer = te_optimizers.FusedAdam(groups, lr=1e-2, betas=(0.9, 0.95), **options)
    return params, optimizer


def train(params, optimizer, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            grad = torch.randn(param.shape, generator=generator).to("cuda")
            if optimizer.use_decoupled_grad:
                param.decoupled_grad = grad
            else:
                param.grad = grad.to(param.dtype)
        optimizer.step()


def trained_state_dict(mode):
    """A saved state dict on the GPU, as the distributed optimizer's scaffold hands it over."""
    params, optimizer = make(mode)
    train(params, optimizer, 3, seed=1)
    torch.cuda.synchronize()
    return [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())


def load_measured(load, optimizer, state_dict):
    """Run ``load`` and return the bytes it allocated above what was live before it."""
    # Earlier tests' garbage (optimizers in reference cycles) freed by a collection during the
    # load would make room for what the load allocates, hiding it from the peak.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    load(optimizer, state_dict)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def restore_params(params, values):
    with torch.no_grad():
        for param, value in zip(params, values):
            param.copy_(value)


def te_state(optimizer, param):
    return {name: optimizer.get_unscaled_state(param, name) for name in optimizer.state[param]}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_fast_path_matches_te_loader_and_allocates_no_more(mode):
    values, saved = trained_state_dict(mode)
    ours_params, ours = make(mode, seed=7)
    theirs_params, theirs = make(mode, seed=7)
    restore_params(ours_params, values)
    restore_params(theirs_params, values)
    # The optimizers exist and their parameters are set before the load starts, as in a resume.
    incoming_ours, incoming_theirs = copy.deepcopy(saved), copy.deepcopy(saved)
    incoming_ptrs = {
        (index, name): tensor.data_ptr()
        for index, entry in incoming_ours["state"].items()
        for name, tensor in entry.items()
    }

    plans = []
    ours_extra = load_measured(
        lambda o, sd: plans.append(
            fsl.load_fused_adam_state_dict(o, sd, precision_aware=mode != "fp32")
        ),
        ours,
        incoming_ours,
    )
    theirs_extra = load_measured(type(theirs).load_state_dict, theirs, incoming_theirs)
    assert plans[0].path == MODES[mode][2], plans[0]

    ordered = [p for g in ours.param_groups for p in g["params"]]
    if plans[0].path == "adopt":
        assert ours_extra == 0, f"the fp32 fast path allocated {ours_extra} bytes"
        for index, param in enumerate(ordered):
            for name, tensor in ours.state[param].items():
                assert tensor.data_ptr() == incoming_ptrs[(index, name)], name
    else:
        assert ours_extra <= theirs_extra, (ours_extra, theirs_extra)
    assert theirs_extra > 0  # TE's loader does allocate: the comparison is not vacuous

    for ours_param, theirs_param in zip(
        ordered, [p for g in theirs.param_groups for p in g["params"]]
    ):
        ours_values, theirs_values = te_state(ours, ours_param), te_state(theirs, theirs_param)
        assert ours_values.keys() == theirs_values.keys()
        for name in ours_values:
            assert torch.equal(ours_values[name], theirs_values[name]), name
    assert [g["step"] for g in ours.param_groups] == [g["step"] for g in theirs.param_groups]

    train(ours_params, ours, 3, seed=2)
    train(theirs_params, theirs, 3, seed=2)
    for ours_param, theirs_param in zip(ours_params, theirs_params):
        assert torch.equal(ours_param, theirs_param)


def test_fp32_fast_path_resumes_the_uninterrupted_run_exactly():
    values, saved = trained_state_dict("fp32")
    reference_params, reference = make("fp32")
    train(reference_params, reference, 3, seed=1)
    train(reference_params, reference, 2, seed=3)

    params, resumed = make("fp32", seed=9)
    restore_params(params, values)
    fsl.load_fused_adam_state_dict(resumed, saved)
    train(params, resumed, 2, seed=3)
    for param, expected in zip(params, reference_params):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("mode", ["bf16_moments_master", "fp16_moments_master"])
def test_a_read_into_the_load_targets_stores_what_te_stores(mode):
    """The distributed optimizer's load targets for precision-aware state: bf16 moments are the
    live tensors (the read casts into them), fp16 moments host fp32 tensors that the write
    scales on the host. Either way the state and scales are TE's own set_scaled_state's, bit
    for bit, and the write holds no fp32 copy of a piece on the GPU."""
    inner = pytest.importorskip("megatron.core.optimizer.inner_optimizer_state")
    params, optimizer = make(mode)
    reference_params, reference = make(mode)
    train(params, optimizer, 2, seed=1)
    train(reference_params, reference, 2, seed=1)
    access = inner.InnerOptimizerState(optimizer, ("exp_avg", "exp_avg_sq"), precision_aware=True)
    generator = torch.Generator().manual_seed(5)
    for param, reference_param in zip(params, reference_params):
        saved = {
            "exp_avg": torch.randn(param.shape, generator=generator) * 1e-3,
            "exp_avg_sq": torch.rand(param.shape, generator=generator) * 1e-6,
            "param": optimizer.get_unscaled_state(param, "master_param").cpu(),
        }
        targets = access.load_targets(param)
        for key in ("exp_avg", "exp_avg_sq"):
            live = optimizer.state[param][key]
            assert (targets[key] is live) == (live.dtype == torch.bfloat16), key
            with torch.no_grad():
                targets[key].copy_(saved[key])  # what the checkpoint read does
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        access.write(param, targets)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < param.numel() * 4
        for key in ("exp_avg", "exp_avg_sq"):
            reference.set_scaled_state(reference_param, key, saved[key].cuda())
            assert torch.equal(optimizer.state[param][key], reference.state[reference_param][key])
            if key in reference._scales.get(
                reference_param, {}
            ):  # pylint: disable=protected-access
                assert torch.equal(
                    optimizer._scales[param][key],  # pylint: disable=protected-access
                    reference._scales[reference_param][key],  # pylint: disable=protected-access
                )
