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
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import (
    PLAIN_TENSORS,
    FusedStep,
    grad_of,
)


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


class InPlaceStepMixin:
    """The HybridDeviceOptimizer's members that step the parameters kept where they live:
    the fp32 clones' widened gradients, the in-place sub-optimizer's step (over runs where
    it can be) and the clones copied back."""

    def _flat_in_place_step(self) -> Optional[FusedStep]:
        """The step that spares the in-place sub-optimizer of the moment its walk over the
        parameters (see :func:`in_place_step`), if it is on."""
        optimizer = self.gpu_optimizer
        if optimizer is None or not self.flat_in_place_steps:
            return None
        if self._flat_in_place is None or self._flat_in_place.optimizer is not optimizer:
            self._flat_in_place = in_place_step(optimizer)
        return self._flat_in_place

    def _step_in_place(self):
        """The in-place sub-optimizer's step, if there is one: over runs of adjacent tensors
        where it is TE's FusedAdam and its state is laid out for that, else its own."""
        flat = self._flat_in_place_step()
        if flat is not None and flat.step():
            return
        if self.gpu_optimizer is not None:
            self.gpu_optimizer.step()
            if flat is not None:
                flat.lay_out()  # so that the next step can take runs

    def _step_clones_from_buffer(self) -> bool:
        """The in-place step where the in-place sub-optimizer steps the fp32 clones alone and
        is TE's FusedAdam (over runs of them) or torch's fused Adam or AdamW (its kernel over
        their lists): their gradients are widened into one buffer laid out like the clones'
        block and handed over from there, with no gradient set on any clone. False (nothing
        stepped) where that does not apply this step."""
        flat, block = self._flat_in_place_step(), self._clone_block
        if flat is None or block is None or not flat.applies():
            return False
        stepped = sum(len(group["params"]) for group in flat.optimizer.param_groups)
        if stepped != len(self._clones_in_place):
            return False
        grads = [grad_of(param) for param, _ in self._clones_in_place]
        if any(grad is None for grad in grads):
            return False
        widened = widened_block(grads)
        if widened is None or widened.numel() != block.numel():
            return False  # a gradient of another size: the offsets would not match
        return flat.step(grads=(widened, block.data_ptr()))

    def _set_sub_optimizer_grads(self) -> List[torch.Tensor]:
        """Give the inner tensors stepped in place their gradients for this step.

        fp32 clones get the widened gradient (``_widen_clone_grads``); parameters stepped as
        they are borrow ``decoupled_grad`` (``_lend_decoupled_grads``). The host
        sub-optimizers' gradients are downloaded bucket by bucket during the step, into the
        ring's slots (``_download``).

        Returns:
            The parameters that borrowed a gradient, to be cleared after the step.
        """
        self._widen_clone_grads()
        return self._lend_decoupled_grads()

    def _widen_clone_grads(self):
        """Give each fp32 clone stepped in place its parameter's gradient, widened."""
        if self._clones_in_place:
            clones = [clone for _, clone in self._clones_in_place]
            grads = [grad_of(param) for param, _ in self._clones_in_place]
            for clone, grad in zip(clones, widened(grads)):
                clone.grad = grad

    def _lend_decoupled_grads(self) -> List[torch.Tensor]:
        """Lend ``decoupled_grad`` as ``grad`` to the parameters stepped as they are.

        torch and TE optimizers read ``grad``, while the precision-aware distributed optimizer
        leaves fp32 shards their gradient in ``decoupled_grad`` only.

        Returns:
            The parameters that borrowed a gradient, to be cleared after the step.
        """
        lent = []
        for param in self._stepped_as_is:
            decoupled = getattr(param, "decoupled_grad", None)
            if decoupled is not None and param.grad is None:
                param.grad = decoupled.to(param.dtype)
                lent.append(param)
        return lent

    def _step_in_place_whole(self):
        """All the in-place side of a step: the clones' widened gradients, the in-place
        sub-optimizer's step, and the clones copied back into their parameters."""
        from_buffer = self._step_clones_from_buffer()
        if not from_buffer:
            self._widen_clone_grads()
            self._step_in_place()
        if self._clones_in_place:
            params, clones = (list(t) for t in zip(*self._clones_in_place))
            torch._foreach_copy_(params, clones)  # pylint: disable=protected-access
            if not from_buffer:
                for clone in clones:
                    clone.grad = None  # the widened gradient is only needed for this step
