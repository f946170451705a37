# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The one table of what the resume harness runs: dtypes, offload fractions, checkpoint formats
and optimizer kinds, with the Megatron ``OptimizerConfig`` options each kind stands for.

Tools, benchmarks and tests pick their rows from here by name or by field (like torch's
``optim_db``), so that adding a format or a kind is one row. Consumers read the module's
attributes when they run, never copies taken at import, so a test can swap the table.
"""

import dataclasses
import importlib.util
from pathlib import Path
from typing import Optional

import torch

DTYPES = ("fp32", "bf16")
OFFLOAD_FRACTIONS = (0.0, 0.5, 1.0)
IMPLEMENTATIONS = ("fork", "upstream")
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Format:
    """A checkpoint format: how the optimizer's state reaches the disk and comes back.

    Attributes:
        name: ``legacy`` or a ``distrib_optim_sharding_type`` of ``sharded_state_dict``.
        dist_checkpoint: written by ``dist_checkpointing.save`` (else ``torch.save`` files).
        round_trips: megatron-core 0.19.2's dist_checkpointing can write and read it at all.
        default_of: the Megatron-LM ``--ckpt-format`` that writes it without further flags.
    """

    name: str
    dist_checkpoint: bool
    round_trips: bool = True
    default_of: Optional[str] = None


def _format_registry():
    """The fork's registry of parameter-state formats (``distrib_optimizer_formats``), read
    from this checkout's tree: it imports nothing, so it loads whichever implementation a
    process runs."""
    path = (
        Path(__file__).resolve().parents[1] / "megatron/core/optimizer/distrib_optimizer_formats.py"
    )
    spec = importlib.util.spec_from_file_location("_fork_format_registry", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _format_rows():
    """legacy (``save_parameter_state``/``load_parameter_state`` plus the optimizer's
    ``state_dict``), then every format of the registry that a sharded state dict describes."""
    registry = _format_registry()
    # The Megatron-LM --ckpt-format that writes a format without further flags.
    defaults = {registry.DP_RESHARDABLE: "torch_dist"}
    # 0.19.2's dist_checkpointing refuses the flattened ShardedTensors this one is made of,
    # whichever implementation writes them: accepted on the command line, never expected to pass.
    unreadable = {registry.FULLY_SHARDED_MODEL_SPACE}
    return (Format("legacy", dist_checkpoint=False, default_of="torch"),) + tuple(
        Format(
            name,
            dist_checkpoint=True,
            round_trips=name not in unreadable,
            default_of=defaults.get(name),
        )
        for name, fmt in registry.FORMATS.items()
        if fmt.builder is not None
    )


FORMAT_ROWS = _format_rows()


@dataclasses.dataclass(frozen=True)
class OptimizerKind:
    """An inner optimizer a case insists on, and the Megatron-LM flags that give it.

    Attributes:
        name: the case-name suffix (``default`` has none).
        te: needs TE FusedAdam; runs without offload, since offload means the
            HybridDeviceOptimizer, whose halves are not TE FusedAdam.
        moment_dtype: dtype of exp_avg and exp_avg_sq (None: whatever megatron-core picks).
        precision_aware: ``--use-precision-aware-optimizer`` with fp32 master weights kept by
            FusedAdam, decoupled grads; needs bf16 parameters.
        remainders: ``store_param_remainders`` (int16 remainders instead of fp32 masters).
        resume_matrix: resumed by the exactness matrix and the main job; the other kinds are
            measured by the load-memory check only.
    """

    name: str
    te: bool = False
    moment_dtype: Optional[torch.dtype] = None
    precision_aware: bool = False
    remainders: bool = False
    resume_matrix: bool = True

    def options(self, offload):
        """The OptimizerConfig fields Megatron-LM's optimizer flags set for this kind."""
        offloaded = offload > 0
        options = {
            "optimizer_cpu_offload": offloaded,
            "optimizer_offload_fraction": offload,
            # Megatron-LM only offloads together with the precision-aware optimizer.
            "use_precision_aware_optimizer": offloaded,
        }
        if self.precision_aware:
            # store_param_remainders defaults to True in OptimizerConfig: always spelt out.
            options.update(
                use_precision_aware_optimizer=True,
                exp_avg_dtype=self.moment_dtype,
                exp_avg_sq_dtype=self.moment_dtype,
                main_params_dtype=torch.float32,
                store_param_remainders=self.remainders,
            )
        return options

    def inner_settings(self):
        """TE FusedAdam attributes the built optimizer must have (empty: no demands)."""
        if not self.te:
            return {}
        settings = {
            "master_weights": self.precision_aware,
            "exp_avg_dtype": self.moment_dtype,
            "exp_avg_sq_dtype": self.moment_dtype,
        }
        if self.precision_aware:
            settings.update(
                master_weight_dtype=torch.float32,
                use_decoupled_grad=True,
                store_param_remainders=self.remainders,
            )
        return settings


OPTIMIZER_KINDS = (
    # megatron-core's own choice of Adam: TE FusedAdam where TE imports, else Apex's, else
    # torch AdamW; the HybridDeviceOptimizer with offload.
    OptimizerKind("default"),
    OptimizerKind("fused_adam", te=True, moment_dtype=torch.float32),
    OptimizerKind("precision_aware", te=True, moment_dtype=torch.bfloat16, precision_aware=True),
    OptimizerKind(
        "precision_aware_remainders",
        te=True,
        moment_dtype=torch.bfloat16,
        precision_aware=True,
        remainders=True,
    ),
    # fp16 moments are kept with per-tensor scales.
    OptimizerKind(
        "precision_aware_fp16",
        te=True,
        moment_dtype=torch.float16,
        precision_aware=True,
        resume_matrix=False,
    ),
)


def _matching(rows, fields):
    return tuple(row.name for row in rows if all(getattr(row, k) == v for k, v in fields.items()))


def format_names(**fields):
    """Names of the formats whose fields have the given values, in table order."""
    return _matching(FORMAT_ROWS, fields)


def kind_names(**fields):
    """Names of the optimizer kinds whose fields have the given values, in table order."""
    return _matching(OPTIMIZER_KINDS, fields)


def optimizer_kind(name):
    """The :class:`OptimizerKind` called ``name``; ValueError for an unknown one."""
    for kind in OPTIMIZER_KINDS:
        if kind.name == name:
            return kind
    raise ValueError(f"optimizer {name!r}: choose from {kind_names()}")
