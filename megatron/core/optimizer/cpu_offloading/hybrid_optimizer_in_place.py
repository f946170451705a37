# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HybridDeviceOptimizer's in-place side: fp32 clones, their widened gradients, the step.

Parameters that are not offloaded are stepped where they live, on fp32 clones where
``param_update_in_fp32`` widens a 16-bit parameter. The clones lie back to back in one block and
their gradients are widened into one buffer laid out alike, so that the in-place step can take
runs of them (:mod:`hybrid_optimizer_flat_in_place`, :mod:`hybrid_optimizer_fused_list`).
"""

from typing import List, Optional, Tuple

import torch
from torch._utils import _unflatten_dense_tensors

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_flat_in_place import FlatInPlaceStep
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_fused_list import (
    FUSED_TORCH_CLASSES,
    FusedListStep,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import PLAIN_TENSORS, FusedStep


def in_place_step(optimizer: torch.optim.Optimizer) -> FusedStep:
    """The step that spares ``optimizer`` its walk over the parameters: over runs for TE's
    FusedAdam (:class:`FlatInPlaceStep`), by its kernel for torch's own fused Adam and AdamW
    (:class:`FusedListStep`)."""
    if type(optimizer) in FUSED_TORCH_CLASSES:
        return FusedListStep(optimizer)
    return FlatInPlaceStep(optimizer)


def fp32_clones(params: List[torch.Tensor]) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
    """fp32 copies of ``params`` and the block they lie in: back to back in the order of
    ``params`` where they share a device (else no block), so that the in-place step can take
    runs of them as one tensor, with their gradients widened into one buffer laid out alike
    (see :mod:`hybrid_optimizer_flat_in_place`)."""
    plain = all(type(p) in PLAIN_TENSORS for p in params)
    if not params or not plain or len({p.device for p in params}) != 1:
        # A DTensor's clone must stay a DTensor: no block.
        return [p.detach().to(torch.float32, copy=True) for p in params], None
    block = torch.empty(
        sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device
    )
    clones = _unflatten_dense_tensors(block, params)
    torch._foreach_copy_(clones, [p.detach() for p in params])  # pylint: disable=protected-access
    return list(clones), block


def widened_block(grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """``grads`` back to back in one fp32 buffer, by one concatenation (no view per gradient);
    None where they differ in dtype or device or are not plain tensors. fp32 gradients (the
    precision-aware optimizer's) are concatenated straight into it; 16-bit ones are concatenated,
    then widened, which holds their 16-bit concatenation beside it for a moment."""
    kinds = {(type(grad), grad.dtype, grad.device) for grad in grads}
    if len(kinds) != 1 or type(grads[0]) not in PLAIN_TENSORS:
        return None
    if any(grad.dim() != 1 for grad in grads):
        grads = [grad.reshape(-1) for grad in grads]
    return torch.cat(grads).to(torch.float32)


def widened(grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """fp32 copies of ``grads`` (None stays None): views into one buffer per device, filled by
    one multi-tensor copy, instead of a cast and an allocation per tensor."""
    present = [grad for grad in grads if grad is not None]
    if not present or len({grad.device for grad in present}) != 1:
        return [None if grad is None else grad.to(torch.float32) for grad in grads]
    flat = torch.empty(
        sum(g.numel() for g in present), dtype=torch.float32, device=present[0].device
    )
    # One C++ loop cuts the views (a Python split and view per tensor costs several times
    # more with thousands of gradients).
    views = _unflatten_dense_tensors(flat, present)
    torch._foreach_copy_(views, present)  # pylint: disable=protected-access
    widened = iter(views)
    return [None if grad is None else next(widened) for grad in grads]
