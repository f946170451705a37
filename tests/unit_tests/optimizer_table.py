# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The one table the unit tests grid over: offload fractions, parameter dtypes, inner optimizer
kinds and checkpoint formats, with helpers that turn its rows into ``pytest.mark.parametrize``
arguments (ids included), the way torch's ``optim_db`` drives its optimizer tests.

It also holds the one import of this folder's helper modules. A test file gets this module with
one try/except (pytest puts this folder on ``sys.path`` while ``tests/`` is no package, as in
this repository; Megatron-LM's ``tests/`` is a package, so there it is
``tests.unit_tests.optimizer_table``) and every other helper through :func:`sibling`, which
imports it under the same package this module was imported under. A module therefore never
loads twice under two names, and no test file repeats the fallback.

The resume harness (``resume_harness/table.py``) has its own table of the same axes for the
tools; this one stands alone because a vendored Megatron-LM tree has no harness. The checkpoint
format names come from the fork's registry (``distrib_optimizer_formats.FORMATS``) where it
imports; without it (upstream's modules, ``MEGATRON_OPTIMIZER_FORK=0``) only the legacy format is
left, and a test gridded over sharded formats alone is skipped for an empty parameter set.
"""

import dataclasses
import importlib
from typing import Optional, Tuple

import pytest
import torch


def sibling(name):
    """This folder's helper or test module ``name``, imported the way this module was.

    Args:
        name (str): the module's file name without ``.py``, e.g. ``"optimizer_doubles"``.
    """
    return importlib.import_module(f"{__package__}.{name}" if __package__ else name)


OFFLOAD_FRACTIONS = (0.0, 0.5, 1.0)
OFFLOADED_FRACTIONS = tuple(f for f in OFFLOAD_FRACTIONS if f > 0)
"""Fractions that send some state to the host (the HDO's copies and host step run)."""
DEVICE_KEPT_FRACTIONS = tuple(f for f in OFFLOAD_FRACTIONS if f < 1)
"""Fractions that keep some state on the device (its in-place half exists)."""

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
"""Parameter dtypes and the short names the resume harness also calls them by."""
DTYPES = tuple(DTYPE_NAMES)


def dtype_params():
    """The parameter dtypes as parametrize values with their short names as ids."""
    return [pytest.param(dtype, id=name) for dtype, name in DTYPE_NAMES.items()]


class DeviceAdamW(torch.optim.AdamW):
    """torch AdamW, fused where its parameters live on CUDA (as Megatron runs it there)."""

    def __init__(self, params, **kwargs):
        params = list(params)
        on_cuda = any(p.is_cuda for group in params for p in group["params"])
        super().__init__(params, fused=True if on_cuda else None, **kwargs)


@dataclasses.dataclass(frozen=True)
class InnerOptimizer:
    """An optimizer class the HybridDeviceOptimizer (or the distributed optimizer) wraps.

    Attributes:
        name: the test id.
        cls: the class; None where it does not import.
        group_step: counts its Adam step once per param group in ``param_group["step"]``
            (TE/Apex FusedAdam's bookkeeping) instead of per parameter.
        te: Transformer Engine's own class (needs TE, and CUDA to step).
    """

    name: str
    cls: Optional[type]
    group_step: bool = False
    te: bool = False

    @property
    def marks(self) -> Tuple:
        """Marks a test using this optimizer needs: a skip where the class does not import."""
        if self.cls is None:
            return (pytest.mark.skip(reason=f"{self.name} does not import"),)
        return ()


_doubles = sibling("optimizer_doubles")
INNER_OPTIMIZERS = (
    # Stands in for TE's FusedAdam where TE is absent: same group-step bookkeeping, any device.
    InnerOptimizer("group_step_adamw", _doubles.GroupStepAdamW, group_step=True),
    InnerOptimizer("torch_adamw", DeviceAdamW),
    InnerOptimizer("te_fused_adam", _doubles.te_fused_adam(), group_step=True, te=True),
)


def inner_optimizer(name):
    """The class of the inner optimizer called ``name``; ValueError for an unknown one."""
    for row in INNER_OPTIMIZERS:
        if row.name == name:
            return row.cls
    raise ValueError(f"inner optimizer {name!r}: choose from {[r.name for r in INNER_OPTIMIZERS]}")


def inner_params(te=False):
    """Inner optimizer names as parametrize values (id: the name); TE's only with ``te``."""
    return [
        pytest.param(row.name, id=row.name, marks=row.marks)
        for row in INNER_OPTIMIZERS
        if te or not row.te
    ]


LEGACY_FORMAT = "legacy"
"""``save_parameter_state``/``load_parameter_state`` files beside the optimizer's state dict
(``torch.save``): the one format that is no ``distrib_optim_sharding_type``."""
NOT_ROUND_TRIPPING = frozenset({"fully_sharded_model_space"})
"""Formats megatron-core 0.19.2's ``dist_checkpointing`` cannot save and load back at all: it
refuses the flattened ShardedTensors they are made of, whichever implementation writes them."""


def _format_registry():
    try:
        from megatron.core.optimizer import (  # pylint: disable=import-outside-toplevel
            distrib_optimizer_formats,
        )
    except ImportError:  # upstream's modules: no registry
        return {}
    return distrib_optimizer_formats.FORMATS


def sharded_formats(round_trips=None):
    """Names of the ``distrib_optim_sharding_type`` formats ``sharded_state_dict`` describes,
    in registry order.

    Args:
        round_trips (bool): only those 0.19.2's ``dist_checkpointing`` can (True) or cannot
            (False) save and load back; None for all.
    """
    return tuple(
        name
        for name, fmt in _format_registry().items()
        if fmt.builder is not None
        and (round_trips is None or (name not in NOT_ROUND_TRIPPING) == round_trips)
    )


def checkpoint_formats(*names, round_trips=None):
    """Checkpoint format names, the legacy one first, then :func:`sharded_formats`.

    Args:
        *names: pick these (in table order); each must be in the table. None: all.
        round_trips (bool): as for :func:`sharded_formats` (legacy always round-trips).
    """
    table = (() if round_trips is False else (LEGACY_FORMAT,)) + sharded_formats(round_trips)
    unknown = set(names) - set(table)
    if unknown and _format_registry():
        raise ValueError(f"formats {sorted(unknown)} are not in the table {table}")
    return tuple(name for name in table if not names or name in names)
