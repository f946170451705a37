# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Cases of the DistributedOptimizer resume check, the probe model's widths, and whether this
machine's Transformer Engine can give a case its optimizer."""

import dataclasses
import functools
import inspect
import itertools

from . import table

# Odd widths give padded params and buckets; BUCKET_SIZE (elements) gives several buckets.
HIDDEN, FFN, BUCKET_SIZE = 40, 72, 4000
# A larger probe keeps about this many buckets, so that memory figures are not lost in
# per-bucket overheads.
BUCKETS_PER_MODEL = 4
# Constructor arguments megatron-core's OptimizerConfig requires of TE FusedAdam before it
# accepts --use-precision-aware-optimizer.
PRECISION_AWARE_ARGUMENTS = (
    "master_weight_dtype",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "use_decoupled_grad",
)
# Below this TE version megatron-core quietly switches store_param_remainders off.
REMAINDERS_TE_VERSION = "2.1.0"


@dataclasses.dataclass(frozen=True)
class Case:
    """One model/optimizer/checkpoint configuration: a dtype, an offload fraction, a format and
    an optimizer kind of :mod:`resume_harness.table`."""

    dtype: str
    offload: float
    fmt: str
    optimizer: str = "default"

    def __post_init__(self):
        kind = table.optimizer_kind(self.optimizer)
        if kind.te and self.offload > 0:
            raise ValueError(f"optimizer {self.optimizer!r} runs without offload only")
        if kind.precision_aware and self.dtype != "bf16":
            raise ValueError(f"optimizer {self.optimizer!r} needs bf16 parameters")

    @property
    def kind(self):
        """The case's :class:`~resume_harness.table.OptimizerKind`."""
        return table.optimizer_kind(self.optimizer)

    @property
    def name(self):
        """Folder and id fragment, e.g. ``bf16-off0.5-dp_reshardable`` or
        ``bf16-off0-dp_reshardable-precision_aware``."""
        tail = "" if self.optimizer == "default" else f"-{self.optimizer}"
        return f"{self.dtype}-off{self.offload:g}-{self.fmt}{tail}"

    def key(self, world, save_with, load_with):
        """Result id, e.g. ``w1-bf16-off0.5-dp_reshardable-fork2upstream``."""
        return f"w{world}-{self.name}-{save_with}2{load_with}"

    @classmethod
    def parse(cls, name):
        """The case a :attr:`name` stands for."""
        parts = name.split("-")
        if len(parts) == 3:
            parts.append("default")
        if len(parts) != 4:
            raise ValueError(f"not a case name: {name!r}")
        dtype, offload, fmt, optimizer = parts
        if (
            dtype not in table.DTYPES
            or not offload.startswith("off")
            or fmt not in table.format_names()
        ):
            raise ValueError(f"not a case name: {name!r}")
        return cls(dtype, float(offload[3:]), fmt, optimizer)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Widths of the probe model; the save job records them and the load job reuses them."""

    hidden: int = HIDDEN
    ffn: int = FFN

    @property
    def numel(self):
        """Parameter count of the probe (three linears, the middle one without bias; a norm)."""
        return 2 * self.hidden * self.ffn + self.ffn * self.ffn + self.ffn + 3 * self.hidden

    @property
    def bucket_size(self):
        """DDP bucket size in elements: several buckets whatever the widths."""
        return max(BUCKET_SIZE, self.numel // BUCKETS_PER_MODEL)


def product(dtypes, offloads, formats, optimizers=("default",)):
    """Every combination of the given values, as cases."""
    return [
        Case(d, float(o), f, opt)
        for d, o, f, opt in itertools.product(dtypes, offloads, formats, optimizers)
    ]


def optimizer_options(case):
    """The OptimizerConfig fields Megatron-LM's optimizer flags set for ``case``."""
    return case.kind.options(case.offload)


@functools.lru_cache(maxsize=None)
def _te_problem(optimizer):
    """Why Transformer Engine cannot give ``optimizer`` here, or None (no TE needed or fine)."""
    # pylint: disable=import-outside-toplevel
    kind = table.optimizer_kind(optimizer)
    if not kind.te:
        return None
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except Exception as error:  # pylint: disable=broad-except
        # Import failures of TE are not only ImportError (missing CUDA libraries, ABI).
        return f"Transformer Engine not importable: {type(error).__name__}: {error}"[:300]
    if kind.precision_aware:
        accepted = inspect.signature(FusedAdam).parameters
        missing = [name for name in PRECISION_AWARE_ARGUMENTS if name not in accepted]
        if missing:
            return f"this TE's FusedAdam lacks {', '.join(missing)} (precision-aware optimizer)"
    if kind.remainders:
        from megatron.core.utils import get_te_version, is_te_min_version

        if not is_te_min_version(REMAINDERS_TE_VERSION):
            return (
                f"TE {get_te_version()} < {REMAINDERS_TE_VERSION}: megatron-core turns "
                "store_param_remainders off there"
            )
    return None


def te_unavailable(case):
    """Why ``case`` cannot run on this machine's Transformer Engine, or None."""
    return _te_problem(case.optimizer)


def selected_cases(args):
    """``args.cases`` (names) if given, else every combination of ``args.dtype``,
    ``args.offload_fraction``, ``args.format`` and ``args.optimizer``."""
    if args.cases:
        return [Case.parse(name) for name in args.cases]
    return product(args.dtype, args.offload_fraction, args.format, args.optimizer)
