# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Creating an optimizer's state without changing anything else: what an in-place checkpoint
load needs before it can read into the state (:func:`materialise_by_null_step`).

A step with a zero learning rate and no weight decay creates the state an optimizer keeps
without moving a parameter or a moment; its step counters are then put back. torch's Adam
and AdamW get theirs allocated directly from an example instead, and any other optimizer's
parameters step in small batches, so that creating the state costs little more than the state.
"""

from typing import Any, Dict, List, Optional

import torch

NULL_STEP_SHARES = 32
"""A null step gives zero gradients to at most this share of the parameters' elements at a
time (``1 / NULL_STEP_SHARES``), so that creating the state costs little more than the state."""


@torch.no_grad()
def materialise_by_null_step(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of every parameter that has none, changing nothing else.

    The parameters without state take a step with a zero learning rate and no weight decay (so
    neither they nor their moments move), after which every step counter the step advanced is
    put back and the param groups are restored. The result is the state a never-stepped
    optimizer would create on its first step.

    Memory: the first step gives no gradients, which is enough for optimizers that create the
    state of every parameter they visit (TE FusedAdam), so that nothing but the state is
    allocated. torch's Adam and AdamW create state only for parameters with a gradient, and
    what they create is known: zero tensors shaped like the parameter and a zero counter
    (:func:`_create_state_by_example`), so theirs is allocated directly, again nothing but the
    state. Other optimizers' parameters still without state then step in batches of at most
    ``1 / NULL_STEP_SHARES`` of the elements (or one parameter, if larger), each with zero
    gradients and whatever temporaries the step needs for that batch alone.

    Args:
        optimizer: any optimizer whose step reads ``lr`` and ``weight_decay`` from its groups.
    """
    groups = optimizer.param_groups
    # Empty parameters get no state: FusedAdam's kernels refuse zero-element tensors.
    fresh = [
        [p for p in group["params"] if not optimizer.state.get(p) and p.numel() > 0]
        for group in groups
    ]
    if not any(fresh):
        return
    saved = [(dict(group), [(p, p.grad) for p in params]) for group, params in zip(groups, fresh)]
    try:
        for group in groups:
            for key in ("lr", "weight_decay"):
                if key in group:
                    value = group[key]
                    group[key] = torch.zeros_like(value) if torch.is_tensor(value) else 0.0
        for params in fresh:
            for param in params:
                param.grad = None
        _step_on(optimizer, fresh)
        remaining = [[p for p in params if not optimizer.state.get(p)] for params in fresh]
        if type(optimizer) in STATE_BY_EXAMPLE:
            remaining = _create_state_by_example(optimizer, remaining)
        for batch in _null_step_batches(remaining):
            for params in batch:
                for param in params:
                    param.grad = torch.zeros_like(param)
            try:
                _step_on(optimizer, batch)
            finally:
                for params in batch:
                    for param in params:
                        param.grad = None
    finally:
        for group, (settings, grads) in zip(groups, saved):
            group.clear()
            group.update(settings)
            for param, grad in grads:
                param.grad = grad
                step = optimizer.state.get(param, {}).get("step")
                if isinstance(step, torch.Tensor):
                    step.zero_()
                elif step is not None:
                    optimizer.state[param]["step"] = 0


STATE_BY_EXAMPLE = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizer classes (exactly these, not subclasses, which may step differently) whose first
step with a zero gradient and learning rate leaves zero tensors shaped like the parameter and
a counter, so that state can be created without the step (:func:`_create_state_by_example`)."""


def _create_state_by_example(
    optimizer: torch.optim.Optimizer, params_per_group: List[List[torch.Tensor]]
) -> List[List[torch.Tensor]]:
    """Give each parameter the state its optimizer's first null step would create.

    Which tensors exist, and the dtype and device of the step counter, depend on the group's
    options (``amsgrad``, ``fused``, ``capturable``) and on the torch version, so they are read
    off a null step of a one-element tensor of the parameter's dtype and device, in a
    throw-away optimizer with the group's settings. Every parameter then gets zero tensors of
    its own shape where the example has per-element state, and a fresh copy of each scalar
    (the counter is reset with the others by :func:`materialise_by_null_step`).

    Returns:
        The parameters (per group) whose example could not be made, for the null step.
    """
    left = []
    for group, params in zip(optimizer.param_groups, params_per_group):
        settings = {key: value for key, value in group.items() if key != "params"}
        examples: Dict[Any, Optional[Dict[str, Any]]] = {}
        left.append([])
        for param in params:
            kind = (param.dtype, param.device)
            if kind not in examples:
                examples[kind] = _example_state(type(optimizer), settings, param)
            if examples[kind] is None:
                left[-1].append(param)
                continue
            # Filled in place, as the step fills it: a wrapper's state map keeps its entry.
            optimizer.state[param].update(
                (key, _shaped_like(value, param)) for key, value in examples[kind].items()
            )
    return left


def _example_state(optimizer_cls, settings: Dict[str, Any], param: torch.Tensor):
    """The state a null step gives a one-element tensor like ``param``, or None where these
    settings do not build such an optimizer."""
    tiny = torch.zeros(1, dtype=param.dtype, device=param.device)
    tiny.grad = torch.zeros_like(tiny)
    try:
        probe = optimizer_cls([{**settings, "params": [tiny]}])
        probe.step()
    except (RuntimeError, TypeError, ValueError):
        return None
    return probe.state.get(tiny) or None  # no state: nothing to copy, so the null step decides


def _shaped_like(example: Any, param: torch.Tensor) -> Any:
    """A zero tensor like ``param`` in ``example``'s dtype for per-element state, a copy of a
    scalar tensor or value otherwise."""
    if not isinstance(example, torch.Tensor):
        return example
    if example.dim() == 0:
        return example.clone()
    return torch.zeros_like(param, dtype=example.dtype, memory_format=torch.preserve_format)


def _step_on(optimizer: torch.optim.Optimizer, params_per_group: List[List[torch.Tensor]]):
    """One step of ``optimizer`` with each group holding only the given parameters."""
    if not any(params_per_group):
        return
    for group, params in zip(optimizer.param_groups, params_per_group):
        group["params"] = params
    optimizer.step()


def _null_step_batches(params_per_group: List[List[torch.Tensor]]):
    """Split parameters (listed per group) into batches of about ``1 / NULL_STEP_SHARES`` of
    their elements, each batch listed per group again."""
    total = sum(p.numel() for params in params_per_group for p in params)
    budget = -(-total // NULL_STEP_SHARES)
    batch = [[] for _ in params_per_group]
    size = 0
    for index, params in enumerate(params_per_group):
        for param in params:
            if size and size + param.numel() > budget:
                yield batch
                batch = [[] for _ in params_per_group]
                size = 0
            batch[index].append(param)
            size += param.numel()
    if size:
        yield batch
