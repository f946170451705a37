# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Which worlds the multi-rank matrix spawns, in which order, and the verdict keys they give.

The CI slice spawns few, small worlds: data-parallel 2 then 4 (4 loads what 2 saved), every
format, torch AdamW and the HybridDeviceOptimizer at 0.5 and 1.0, expert parameters in one
family, the faults at 4. The full matrix adds both dtypes with every
fraction, DP 8 (it loads DP 2's checkpoints, DP 4 loads DP 8's, and a second DP 2 world loads
both larger sizes'), TP 2 x DP 2, faults at 8, and upstream 0.19.2 in every world.
"""

from dataclasses import replace

from .cases import Case
from .multirank import WorldSpec
from .multirank_faults import FAULT_FORMATS, fault_keys
from .multirank_rank import Cell
from .table import format_names

FORMATS = format_names(round_trips=True)
SLICE_FAMILIES = (("fp32", 0.0, False), ("bf16", 0.5, True), ("fp32", 1.0, False))
FULL_FAMILIES = tuple(
    (dtype, offload, experts)
    for dtype in ("fp32", "bf16")
    for offload in (0.0, 0.5, 1.0)
    for experts in (False, True)
    if not experts or offload == 0.5
)


def cells(families):
    """Every format of each ``(dtype, offload, experts)`` family."""
    return tuple(
        Cell(Case(dtype, offload, fmt), experts)
        for dtype, offload, experts in families
        for fmt in FORMATS
    )


def worlds(full, device="cpu", max_world=None):
    """The worlds of the CI slice (``full`` False) or of the whole matrix, in spawn order,
    each with its verdict keys; ``max_world`` leaves out larger worlds (and loads of what
    they would have saved)."""
    families = FULL_FAMILIES if full else SLICE_FAMILIES
    matrix = cells(families)
    faults = tuple(FAULT_FORMATS)
    plan = []
    for implementation in ("fork", "upstream") if full else ("fork",):
        if not full:
            plan.append((WorldSpec(2, matrix, implementation, device), ()))
            plan.append((WorldSpec(4, matrix, implementation, device, faults=faults), (2,)))
            continue
        plan += [
            (WorldSpec(2, matrix, implementation, device), ()),
            (WorldSpec(8, matrix, implementation, device, faults=faults), (2,)),
            (WorldSpec(4, matrix, implementation, device, faults=faults), (2, 8)),
            (WorldSpec(2, matrix, implementation, device, save=False), (4, 8)),
            (WorldSpec(4, matrix, implementation, device, tensor_parallel=2), ()),
        ]
    if max_world:
        plan = [(spec, loads) for spec, loads in plan if spec.size <= max_world]
        sizes = {spec.data_parallel for spec, _ in plan if spec.tensor_parallel == 1}
        plan = [(spec, tuple(size for size in loads if size in sizes)) for spec, loads in plan]
    return [
        (spec if not loads else _with_loads(spec, loads), keys(spec, loads)) for spec, loads in plan
    ]


def across_versions(tree, families=SLICE_FAMILIES, device="cpu"):
    """The worlds in which this checkout's fork and that of checkout ``tree`` load each other's
    checkpoints, with their verdict keys: each saves every format of ``families`` at DP 2 (and
    resumes its own), then each loads what the other saved, at DP 2 and at DP 4."""
    matrix = cells(families)
    other = WorldSpec(2, matrix, device=device, fork_tree=tree)
    this = WorldSpec(2, matrix, device=device)
    plan = [other, this]
    for loader, saver in ((this, other), (other, this)):
        for size in (2, 4):
            plan.append(
                replace(
                    loader, size=size, save=False, saved_by=saver.implementation_tag, load_from=(2,)
                )
            )
    return [(spec, keys(spec, spec.load_from)) for spec in plan]


def _with_loads(spec, loads):
    return replace(spec, load_from=loads)


def keys(spec, loads):
    """The verdict keys ``spec`` gives when it loads the sizes ``loads``."""
    found = []
    for cell in spec.cells:
        prefix = f"{spec.tag}-{cell.name}"
        if spec.save:
            found += [f"{prefix}-save", f"{prefix}-resume"]
        found += [f"{prefix}-{spec.load_key(size)}" for size in loads]
    return found + fault_keys(spec.tag, spec.faults)
