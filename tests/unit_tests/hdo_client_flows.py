# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""What RL frameworks do with a HybridDeviceOptimizer's state between training phases.

Each function plays one client's part on ``optimizer.state`` the way those frameworks write
it (verl and SkyRL move tensors by reassignment, megatron-core's ``offload_to_cpu`` and
``restore_from_cpu`` do the same through the wrapping optimizer), so the tests can check that
the optimizer moves the state it steps. Works with upstream's HDO as with the fork's.

Imported as ``hdo_client_flows`` (pytest puts this folder on ``sys.path``) or as
``tests.unit_tests.hdo_client_flows`` from a checkout whose ``tests/`` is a package.
"""

import contextlib
import gc

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def build_hdo(hdo_class, shapes, fraction, seed=0, dtype=torch.bfloat16, device="cpu"):
    """Parameters of ``shapes`` and an HDO over them in two param groups (the second with
    weight decay), with torch AdamW on both sides as Megatron's factory configures it
    (``param_update_in_fp32``, ``fused``)."""
    generator = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(device, dtype))
        for shape in shapes
    ]
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]
    optimizer = hdo_class(
        groups,
        offload_fraction=fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    return params, optimizer


def train_params(params, optimizer, steps, seed):
    """``steps`` steps with gradients drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            grad = torch.randn(param.shape, generator=generator)
            param.grad = grad.to(param.device, param.dtype)
        optimizer.step()
        optimizer.zero_grad()


def offload_state_by_reassignment(hdo):
    """Put every state tensor on the host by assigning ``state[p][key] = t.to("cpu")``."""
    for entry in hdo.state.values():
        for key, value in list(entry.items()):
            if isinstance(value, torch.Tensor):
                entry[key] = value.to("cpu", non_blocking=True)


def client_master_update(calls):
    """A client's class-level replacement of ``_update_fp32_params_by_new_state`` (SkyRL's
    shape): copy each entry's ``master_param`` into the fp32 copy of the parameters that have
    one. Each call appends the optimizer to ``calls``."""

    def update(self):
        calls.append(self)
        if not self.param_update_in_fp32:
            return
        for param, entry in self.state.items():
            fp32 = self.param_to_fp32_param.get(param)
            if fp32 is not None and "master_param" in entry:
                fp32.data.copy_(entry["master_param"])

    return update


def reload_moments_to_the_accelerator(hdo, device="cuda"):
    """Bring the moments back with ``.to(device)`` (what clients do without the HDO's own
    ``_move_new_state_to_right_device``)."""
    for entry in hdo.state.values():
        for key in MOMENTS:
            if key in entry:
                entry[key] = entry[key].to(device, non_blocking=True)


def reload_state_by_the_hdo(hdo):
    """Bring the state back with the HDO's ``_move_new_state_to_right_device()``."""
    hdo._move_new_state_to_right_device()  # pylint: disable=protected-access


def accelerator_state_bytes(hdo, keys=None):
    """Bytes of ``hdo``'s state tensors on the accelerator.

    Counts each distinct storage once and leaves out what is not state of its own: a
    ``master_param`` that is the tensor the optimizer steps (the parameter or its copy).

    Args:
        hdo: the optimizer.
        keys: the state keys to count (all by default).
    """
    inner_of = getattr(hdo, "param_to_inner_param", {})
    seen = {}
    for param, entry in hdo.state.items():
        stepped = {id(param), id(inner_of.get(param, param))}
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or not value.is_cuda:
                continue
            if id(value) in stepped or (keys is not None and key not in keys):
                continue
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def misplaced_state(hdo):
    """``(key, state device, inner device)`` of every non-step state tensor that is not on
    the device of the tensor the optimizer steps for it."""
    inner_of = getattr(hdo, "param_to_inner_param", {})
    found = []
    for param, entry in hdo.state.items():
        inner = inner_of.get(param, param)
        for key, value in entry.items():
            if key != "step" and isinstance(value, torch.Tensor):
                if value.device != inner.device:
                    found.append((key, str(value.device), str(inner.device)))
    return found


@contextlib.contextmanager
def measured_memory():
    """Collect garbage first and hold the collector off inside, so that accelerator memory
    read in the block moves only with what the block itself does."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def allocated():
    """Accelerator bytes that live tensors asked for, once pending work is done (what the
    caching allocator hands out can exceed a request by up to a block's slack)."""
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["requested_bytes.all.current"]
