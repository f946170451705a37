# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin,import-outside-toplevel
"""Resume check for the DistributedOptimizer: save with one implementation, load with another.

A small Megatron model is wrapped in megatron-core's DistributedDataParallel (distributed
optimizer, several buckets) and given the optimizer ``get_megatron_optimizer`` builds for it:
without offload whatever Adam megatron-core picks (TE FusedAdam where Transformer Engine
imports, else Apex's, else torch AdamW), or the HybridDeviceOptimizer with precision-aware
state when a share of the state is offloaded. A case's ``optimizer`` can instead insist on TE
FusedAdam, fp32 moments (``fused_adam``) or Megatron-LM's ``--use-precision-aware-optimizer``
with bf16 moments and fp32 master weights, without (``precision_aware``) or with
(``precision_aware_remainders``) ``store_param_remainders``; where TE cannot provide that the
case is skipped with the reason, never measured on another optimizer.

Each case trains ``--steps-before`` steps on fixed per-rank data, saves a checkpoint, and goes
on for ``--steps-after`` steps; the resulting parameters and optimizer state are the reference.
The load side builds a fresh model and optimizer (other initial weights), loads the
checkpoint, takes the same steps and compares everything with ``torch.equal``. It also records
pinned host memory the process holds at cold start, after the load and after the resumed
steps, the peak GPU memory the load added (the
``is_loading`` sharded state dict and the load itself), the load time, and the path the fork's
FusedAdam loader logged.

Save and load are separate ``torchrun`` invocations sharing a checkpoint folder, so that each
can run either implementation (``upstream`` runs with ``MEGATRON_OPTIMIZER_FORK=0``)::

    torchrun --nproc-per-node 2 tools/distopt_resume.py --save-with fork --ckpt-dir D \\
        --dtype bf16 --offload-fraction 0.5 --format dp_reshardable fully_reshardable
    MEGATRON_OPTIMIZER_FORK=0 torchrun --nproc-per-node 2 tools/distopt_resume.py \\
        --load-with upstream --ckpt-dir D --out result.json

Without torchrun, naming both sides runs the two invocations itself::

    python tools/distopt_resume.py --save-with upstream --load-with fork --nproc-per-node 1 \\
        --dtype fp32 bf16 --out result.json

Case names are ``<dtype>-off<fraction>-<format>[-<optimizer>]``, e.g.
``bf16-off0-dp_reshardable-precision_aware`` (``--cases``), or ``--optimizer`` beside
``--dtype``/``--offload-fraction``/``--format``.

Loading a fork checkpoint with upstream also runs the ``upstream2upstream`` control: a case
upstream fails with its own checkpoint too is reported, not counted against the fork.

Formats: ``legacy`` (``save_parameter_state``/``load_parameter_state`` plus the optimizer's
``state_dict``) and the ``distrib_optim_sharding_type`` values of megatron-core 0.19.2's
``sharded_state_dict``. ``fully_sharded_model_space`` is accepted but 0.19.2's
dist_checkpointing refuses flattened ShardedTensors, so it fails with either implementation.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import inspect
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from megatron_optimizer_fork.memory import pinned_bytes_held, release_cached_pinned_memory

MODULE = "megatron.core.optimizer.distrib_optimizer"
REPO_ROOT = Path(__file__).resolve().parents[1]
IMPLEMENTATIONS = ("fork", "upstream")
# Upstream resuming its own checkpoint: whatever fails here is megatron-core's own bug and is
# not counted against the fork where the fork's checkpoint fails the same way in upstream.
CONTROL_PAIR = ("upstream", "upstream")
DTYPES = ("fp32", "bf16")
OFFLOAD_FRACTIONS = (0.0, 0.5, 1.0)
FORMATS = (
    "legacy",
    "dp_zero_gather_scatter",
    "dp_reshardable",
    "fully_reshardable",
    "fully_sharded_model_space",
)
# Odd widths give padded params and buckets; BUCKET_SIZE (elements) gives several buckets.
HIDDEN, FFN, BATCH, BUCKET_SIZE = 40, 72, 8, 4000
# A larger probe keeps about this many buckets, so that memory figures are not lost in
# per-bucket overheads.
BUCKETS_PER_MODEL = 4
TRAIN_STREAM, FOLLOW_UP_STREAM = 1, 2
SAVE_SEED, LOAD_SEED = 1, 7
MANIFEST = "manifest.json"
# "default" keeps megatron-core's own choice of Adam (and the case names from before the
# variants existed); the others only make sense on TE FusedAdam, without offload.
OPTIMIZERS = (
    "default",
    "fused_adam",
    "precision_aware",
    "precision_aware_remainders",
    "precision_aware_fp16",
)
TE_OPTIMIZERS = OPTIMIZERS[1:]
PRECISION_AWARE = OPTIMIZERS[2:]
# Moment dtype of each precision-aware variant (fp16 moments are kept with per-tensor scales).
MOMENT_DTYPES = {"precision_aware_fp16": torch.float16}
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
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
PLAN_LOGGER = "megatron.core.optimizer.fused_adam_state_load"


@dataclasses.dataclass(frozen=True)
class Case:
    """One model/optimizer/checkpoint configuration."""

    dtype: str
    offload: float
    fmt: str
    optimizer: str = "default"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: choose from {OPTIMIZERS}")
        if self.optimizer in TE_OPTIMIZERS and self.offload > 0:
            # Offload means the HybridDeviceOptimizer, whose halves are not TE FusedAdam.
            raise ValueError(f"optimizer {self.optimizer!r} runs without offload only")
        if self.optimizer in PRECISION_AWARE and self.dtype != "bf16":
            raise ValueError(f"optimizer {self.optimizer!r} needs bf16 parameters")

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
        if dtype not in DTYPES or not offload.startswith("off") or fmt not in FORMATS:
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


@functools.lru_cache(maxsize=None)
def _te_problem(optimizer):
    """Why Transformer Engine cannot give ``optimizer`` here, or None (no TE needed or fine)."""
    if optimizer not in TE_OPTIMIZERS:
        return None
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except Exception as error:  # pylint: disable=broad-except
        # Import failures of TE are not only ImportError (missing CUDA libraries, ABI).
        return f"Transformer Engine not importable: {type(error).__name__}: {error}"[:300]
    if optimizer in PRECISION_AWARE:
        accepted = inspect.signature(FusedAdam).parameters
        missing = [name for name in PRECISION_AWARE_ARGUMENTS if name not in accepted]
        if missing:
            return f"this TE's FusedAdam lacks {', '.join(missing)} (precision-aware optimizer)"
    if optimizer == "precision_aware_remainders":
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


# --------------------------------------------------------------------------- inside torchrun


def _select_implementation(implementation):
    """Route ``megatron.core.optimizer`` to the requested code and prove it did.

    Must run before anything imports ``megatron.core.optimizer``.
    """
    import megatron_optimizer_fork as overlay

    if implementation == "upstream":
        os.environ[overlay.ENV_VAR] = "0"
    elif not overlay.is_enabled():
        raise SystemExit(f"--*-with fork, but {overlay.ENV_VAR} switches the overlay off")
    else:
        overlay.install()
    module = importlib.import_module(MODULE)
    path = Path(module.__file__).resolve()
    fork_dir = Path(overlay.fork_package_dir("megatron.core.optimizer")).resolve()
    if (path.parent == fork_dir) != (implementation == "fork"):
        raise SystemExit(f"asked for the {implementation} implementation, got {path}")
    return str(path)


class Rank:
    """This process's place in the job, and the process groups Megatron needs."""

    def __init__(self, timeout_s):
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(self.local)
        torch.distributed.init_process_group(
            "nccl",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", self.local),
        )
        self.rank = torch.distributed.get_rank()
        self.world = torch.distributed.get_world_size()
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()

    def barrier(self):
        """Wait for every rank."""
        torch.distributed.barrier(device_ids=[self.local])

    @staticmethod
    def close():
        """Tear the groups down so the launcher sees a clean exit."""
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _probe_class(shape):
    from megatron.core.transformer.module import MegatronModule

    class ResumeProbe(MegatronModule):
        """Three linear layers and a norm; the middle one without bias."""

        def __init__(self, config):
            super().__init__(config)
            self.inp = torch.nn.Linear(shape.hidden, shape.ffn)
            self.mid = torch.nn.Linear(shape.ffn, shape.ffn, bias=False)
            self.out = torch.nn.Linear(shape.ffn, shape.hidden)
            self.norm = torch.nn.LayerNorm(shape.hidden)

        def forward(self, x):  # pylint: disable=missing-function-docstring
            hidden = torch.tanh(self.mid(torch.nn.functional.gelu(self.inp(x))))
            return self.norm(self.out(hidden) + x)

    return ResumeProbe


def _torch_dtype(case):
    return torch.bfloat16 if case.dtype == "bf16" else torch.float32


def optimizer_options(case):
    """The OptimizerConfig fields Megatron-LM's optimizer flags set for ``case.optimizer``."""
    offloaded = case.offload > 0
    options = {
        "optimizer_cpu_offload": offloaded,
        "optimizer_offload_fraction": case.offload,
        # Megatron-LM only offloads together with the precision-aware optimizer.
        "use_precision_aware_optimizer": offloaded,
    }
    if case.optimizer in PRECISION_AWARE:
        # --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 (or
        # fp16) with fp32 main params: FusedAdam keeps the master weights and reads decoupled
        # grads. store_param_remainders defaults to True in OptimizerConfig, so it is always
        # spelt out.
        moments = MOMENT_DTYPES.get(case.optimizer, torch.bfloat16)
        options.update(
            use_precision_aware_optimizer=True,
            exp_avg_dtype=moments,
            exp_avg_sq_dtype=moments,
            main_params_dtype=torch.float32,
            store_param_remainders=case.optimizer == "precision_aware_remainders",
        )
    return options


def _expected_inner_settings(case):
    """TE FusedAdam attributes ``case.optimizer`` must end up with (empty: no demands)."""
    if case.optimizer == "fused_adam":
        return {
            "master_weights": False,
            "exp_avg_dtype": torch.float32,
            "exp_avg_sq_dtype": torch.float32,
        }
    if case.optimizer not in PRECISION_AWARE:
        return {}
    moments = MOMENT_DTYPES.get(case.optimizer, torch.bfloat16)
    return {
        "master_weights": True,
        "master_weight_dtype": torch.float32,
        "exp_avg_dtype": moments,
        "exp_avg_sq_dtype": moments,
        "use_decoupled_grad": True,
        "store_param_remainders": case.optimizer == "precision_aware_remainders",
    }


def inner_settings(case, optimizer):
    """The inner optimizers' class and precision settings; raises where ``case`` asked for
    something else, so that no figure is recorded for an optimizer the case does not name."""
    wanted = _expected_inner_settings(case)
    settings = {}
    for dist in distributed_optimizers(optimizer):
        inner = dist.optimizer
        name = f"{type(inner).__module__}.{type(inner).__name__}"
        if case.optimizer in TE_OPTIMIZERS and not name.startswith("transformer_engine."):
            raise RuntimeError(f"{case.name} asked for TE FusedAdam, megatron-core built {name}")
        found = {key: getattr(inner, key, None) for key in wanted}
        wrong = {key: value for key, value in found.items() if value != wanted[key]}
        if wrong:
            raise RuntimeError(f"{case.name}: {name} has {wrong}, expected {wanted}")
        settings[name] = {key: str(value) for key, value in found.items()}
    return settings


def build(case, seed, shape=Shape()):
    """DDP-wrapped probe model of ``shape`` and the optimizer Megatron builds for ``case``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    problem = te_unavailable(case)
    if problem:
        raise RuntimeError(f"{case.name} not run: {problem}")
    bf16, dtype = case.dtype == "bf16", _torch_dtype(case)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=1, bf16=bf16, params_dtype=dtype
    )
    module = _probe_class(shape)(config).cuda().to(dtype)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=bf16, bucket_size=shape.bucket_size
    )
    model = DistributedDataParallel(config, ddp_config, module)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            weight_decay=0.01,
            bf16=bf16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
            clip_grad=1.0,
            **optimizer_options(case),
        ),
        [model],
    )
    return model, optimizer


def distributed_optimizers(optimizer):
    """The DistributedOptimizers behind Megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def train(model, optimizer, case, stream, steps, rank, shape=Shape()):
    """``steps`` optimizer steps on data fixed by (stream, step, rank)."""
    dtype = _torch_dtype(case)
    for step in range(steps):
        generator = torch.Generator(device="cuda")
        generator.manual_seed(1_000_003 * stream + 1_009 * step + rank)
        size = (BATCH, shape.hidden)
        inputs = torch.randn(size, generator=generator, device="cuda", dtype=dtype)
        target = torch.randn(size, generator=generator, device="cuda", dtype=dtype)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = (model(inputs).float() - target.float()).pow(2).mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()


def _plain(value):
    """A comparable copy of a state-dict tree: tensors become Python numbers or lists."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def snapshot(model, optimizer):
    """Parameters, this rank's optimizer state by parameter name, and the common state dict."""
    names = {param: name for name, param in model.named_parameters()}
    params = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    state = {}
    for index, dist in enumerate(distributed_optimizers(optimizer)):
        # Only parameters with a shard on this rank appear in this map.
        for param in dist.model_param_group_index_map:
            tensors = dist._get_main_param_and_optimizer_states(  # pylint: disable=protected-access
                param
            )
            state[f"{index}/{names[param]}"] = {
                key: value.detach().to("cpu", copy=True)
                for key, value in tensors.items()
                if isinstance(value, torch.Tensor)
            }
    return {"params": params, "state": state, "common": _plain(optimizer.state_dict())}


def _tensor_difference(expected, actual):
    """(equal, max abs diff) of two tensors; shapes or dtypes that differ count as inf."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return False, float("inf")
    if torch.equal(expected, actual):
        return True, 0.0
    if expected.numel() == 0:
        return False, float("inf")
    return False, (expected.double() - actual.double()).abs().max().item()


def _common_difference(expected, actual, path="common"):
    """Paths where two plain trees disagree; keys only one side has are reported apart."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found, only = [], sorted(set(expected) ^ set(actual), key=str)
        for key in set(expected) & set(actual):
            found += _common_difference(expected[key], actual[key], f"{path}.{key}")
        return found + [f"{path}.{key} (one side only)" for key in only]
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        found = []
        for index, (left, right) in enumerate(zip(expected, actual)):
            found += _common_difference(left, right, f"{path}[{index}]")
        return found
    return [] if expected == actual else [f"{path}: {expected!r} != {actual!r}"]


def compare(reference, resumed):
    """Bit-exactness of the resumed run against the reference, with the first mismatches."""
    mismatches, worst = [], 0.0
    exact = {"params": True, "state": True}
    for kind in ("params", "state"):
        want, have = reference[kind], resumed[kind]
        for name in sorted(set(want) | set(have)):
            if name not in want or name not in have:
                exact[kind] = False
                mismatches.append(
                    f"{kind} {name}: only in {'reference' if name in want else 'resumed'}"
                )
                continue
            pairs = [(name, want[name], have[name])]
            if kind == "state":
                # Whether the getter hands out torch's 0-dim "step" differs between versions
                # and optimizers; it is compared by value where both sides have it, and the
                # per-element state is what must match key for key.
                unmatched = (set(want[name]) ^ set(have[name])) - {"step"}
                if unmatched:
                    exact[kind] = False
                    mismatches.append(
                        f"state {name}: keys {sorted(want[name])} != {sorted(have[name])}"
                    )
                pairs = [
                    (f"{name}[{key}]", want[name][key], have[name][key])
                    for key in sorted(set(want[name]) & set(have[name]))
                ]
            for label, expected, actual in pairs:
                equal, diff = _tensor_difference(expected, actual)
                worst = max(worst, diff)
                if not equal:
                    exact[kind] = False
                    mismatches.append(f"{kind} {label}: max |diff| {diff:.3g}")
    common = _common_difference(reference["common"], resumed["common"])
    value_drift = [entry for entry in common if not entry.endswith("(one side only)")]
    return {
        "params_exact": exact["params"],
        "state_exact": exact["state"],
        "common_equal": not value_drift,
        "common_differences": common[:20],
        "max_abs_diff": worst,
        "mismatches": mismatches[:20],
    }


def save_checkpoint(case, model, optimizer, folder, rank):
    """Write ``case.fmt`` into ``folder`` the way Megatron-LM's checkpointing does."""
    if case.fmt == "legacy":
        optimizer.save_parameter_state(str(folder / "param_state.pt"))
        common = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if rank.rank == 0:
            torch.save(common, folder / "common.pt")
        return
    from megatron.core import dist_checkpointing

    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": case.fmt}
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata),
    }
    target = folder / "dist"
    if rank.rank == 0:
        target.mkdir()
    rank.barrier()
    dist_checkpointing.save(state, str(target))


def _needs_priming(case, implementation, optimizer, policy):
    if policy != "auto":
        return policy == "always"
    # Upstream 0.19.2 without TE/Apex reads a 'step' from every state entry while describing
    # itself for a dist-checkpoint load, so it cannot describe an optimizer that never stepped.
    # The fork is never primed: loading into a fresh optimizer is part of what is tested.
    # With TE or Apex FusedAdam upstream allocates the state inside its own is_loading pass, so
    # priming it would only hide that allocation from the load's peak.
    if implementation != "upstream" or case.fmt == "legacy":
        return False
    return any(
        not dist.optimizer.state and not _is_fused_adam(dist.optimizer)
        for dist in distributed_optimizers(optimizer)
    )


def _is_fused_adam(inner):
    return type(inner).__module__.startswith(("transformer_engine.", "apex."))


def prime(optimizer):
    """Materialise optimizer state with upstream's own helpers (values are overwritten)."""
    for dist in distributed_optimizers(optimizer):
        if dist.optimizer.state:
            continue
        if hasattr(dist.optimizer, "dummy_step"):
            dist.optimizer.dummy_step()
        else:
            dist._init_optimizer_states_with_dummy_values()  # pylint: disable=protected-access


class PhasePeaks:
    """Peak GPU memory of each phase of a load, and what stays allocated after it, above what
    was allocated when the load started.

    The peak counter is reset as each phase begins, so the largest phase peak is the peak of
    the whole load.
    """

    def __init__(self):
        torch.cuda.synchronize()
        self.start = torch.cuda.memory_allocated()
        self.peaks = {}
        self.after = {}

    @contextlib.contextmanager
    def phase(self, name):
        """Measure the block as phase ``name``."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()
        self.peaks[name] = torch.cuda.max_memory_allocated() - self.start
        self.after[name] = torch.cuda.memory_allocated() - self.start


def optimizer_state_bytes(optimizer):
    """Bytes of the inner optimizers' per-parameter state, by device kind: ``"moments"``
    (exp_avg and exp_avg_sq in their stored dtype: one state set) and ``"all"`` (every
    state tensor: master copies or remainders, scales, step counters too)."""
    found = {f"{place}_{what}": 0 for place in ("gpu", "host") for what in ("moments", "all")}
    for dist in distributed_optimizers(optimizer):
        seen = set()
        for entry in dist.optimizer.state.values():
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor) or value.data_ptr() in seen:
                    continue
                seen.add(value.data_ptr())
                size = value.numel() * value.element_size()
                place = "gpu" if value.is_cuda else "host"
                found[f"{place}_all"] += size
                if key in MOMENT_KEYS:
                    found[f"{place}_moments"] += size
    return found


def load_checkpoint(case, model, optimizer, folder, peaks):
    """Read ``case.fmt`` from ``folder`` into a fresh model and optimizer, each phase measured
    by ``peaks`` (:class:`PhasePeaks`)."""
    if case.fmt == "legacy":
        with peaks.phase("state_dict"):
            common = torch.load(folder / "common.pt", map_location="cpu", weights_only=False)
            model.load_state_dict(common["model"])
            optimizer.load_state_dict(common["optimizer"])
        with peaks.phase("param_state"):
            optimizer.load_parameter_state(str(folder / "param_state.pt"))
        return
    from megatron.core import dist_checkpointing

    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": case.fmt}
    # The first load pass: describing the optimizer for the load builds its state scaffold.
    with peaks.phase("is_loading"):
        state = {
            "model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata),
        }
    with peaks.phase("read"):
        loaded = dist_checkpointing.load(state, str(folder / "dist"))
    with peaks.phase("load_state_dict"):
        # The sharded keys carry the DDP wrapper's "module." prefix; its load_state_dict not.
        model.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()})
        optimizer.load_state_dict(loaded["optimizer"])


class LoadPlanLog(logging.Handler):
    """Collects what the fork's FusedAdam loader logs about the path it took, while in a
    ``with`` block (INFO is let through that one logger for the time being)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []
        self._logger = logging.getLogger(PLAN_LOGGER)
        self._level = None

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self._level = self._logger.level
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc_info):
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


def _release():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _error_text(error):
    # The whole traceback goes to the log; the result keeps the message.
    traceback.print_exc()
    return f"{type(error).__name__}: {error}".replace("\n", " ")[:2000]


def _write_json(path, payload):
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str), encoding="utf-8")
    tmp.replace(path)


def _save_one(case, folder, args, rank):
    """Train, checkpoint, go on, and keep this rank's reference snapshot."""
    shape = Shape(args.hidden, args.ffn)
    model, optimizer = build(case, SAVE_SEED, shape)
    inner_settings(case, optimizer)
    train(model, optimizer, case, TRAIN_STREAM, args.steps_before, rank.rank, shape)
    save_checkpoint(case, model, optimizer, folder, rank)
    rank.barrier()
    train(model, optimizer, case, FOLLOW_UP_STREAM, args.steps_after, rank.rank, shape)
    torch.save(snapshot(model, optimizer), folder / f"reference_rank{rank.rank}.pt")


def run_save(args, rank, module_file):
    """Train, save, go on, store the reference: one folder per case under ``--ckpt-dir``."""
    root = Path(args.ckpt_dir[0])
    cases = selected_cases(args)
    if rank.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        manifest = {
            "save_with": args.save_with,
            "world": rank.world,
            "module_file": module_file,
            "steps_before": args.steps_before,
            "steps_after": args.steps_after,
            "shape": dataclasses.asdict(Shape(args.hidden, args.ffn)),
            "cases": [dataclasses.asdict(case) for case in cases],
        }
        _write_json(root / MANIFEST, manifest)
    for case in cases:
        folder = root / case.name
        if rank.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
        rank.barrier()
        if rank.rank == 0:
            print(f"{time.strftime('%H:%M:%S')} save {case.name}", flush=True)
        try:
            _save_one(case, folder, args, rank)
            status = {"ok": True, "error": None}
        except Exception as error:  # pylint: disable=broad-except
            status = {"ok": False, "error": _error_text(error)}
            print(f"[rank {rank.rank}] save {case.name} failed: {status['error']}", flush=True)
        _write_json(folder / f"status_rank{rank.rank}.json", status)
        _release()
    rank.barrier()


def _saved_cases(root, world):
    manifest = json.loads((Path(root) / MANIFEST).read_text(encoding="utf-8"))
    if manifest["world"] != world:
        raise SystemExit(f"{root} was saved by {manifest['world']} ranks, this job has {world}")
    return manifest, [Case(**fields) for fields in manifest["cases"]]


def _save_error(folder, world):
    for index in range(world):
        path = folder / f"status_rank{index}.json"
        if not path.exists():
            return f"no save status from rank {index}"
        status = json.loads(path.read_text(encoding="utf-8"))
        if not status["ok"]:
            return f"save failed on rank {index}: {status['error']}"
    return None


def load_one(case, folder, args, rank, manifest, result, built=None):
    """Load one saved case, resume, compare: this rank's figures go into ``result``.

    ``result`` is filled as the case goes, so that what was measured before an exception
    survives it; ``built`` (called with ``result``) records the cold-start figures before the
    load starts, so that they survive a load that ends the process too.
    """
    result.update(error=_save_error(folder, rank.world), primed=False)
    if result["error"]:
        return result
    shape = Shape(**manifest.get("shape", {}))
    # What the process holds pinned at cold start includes what building the optimizer freed
    # into the allocator's cache, so the cache of the previous case is emptied first.
    release_cached_pinned_memory()
    model, optimizer = build(case, LOAD_SEED, shape)
    result["pinned_cold_bytes"] = pinned_bytes_held()
    result["instance_attributes"] = sorted(vars(distributed_optimizers(optimizer)[0]))
    inner = distributed_optimizers(optimizer)[0].optimizer
    result["inner_optimizer"] = f"{type(inner).__module__}.{type(inner).__name__}"
    result["inner_settings"] = inner_settings(case, optimizer)
    if built:
        built(result)
    _release()
    if _needs_priming(case, args.load_with, optimizer, args.prime):
        prime(optimizer)
        result["primed"] = True
    peaks = PhasePeaks()
    with LoadPlanLog() as plans:
        start = time.perf_counter()
        load_checkpoint(case, model, optimizer, folder, peaks)
        torch.cuda.synchronize()
        result["load_seconds"] = time.perf_counter() - start
    # Only rank 0 of the fork logs; upstream has no such logger.
    result["fused_adam_load_plans"] = plans.messages
    result["load_phase_peak_gpu_extra_bytes"] = peaks.peaks
    result["load_phase_after_gpu_extra_bytes"] = peaks.after
    result["load_peak_gpu_extra_bytes"] = max(peaks.peaks.values())
    result["optimizer_state_bytes"] = optimizer_state_bytes(optimizer)
    gc.collect()
    result["pinned_after_load_bytes"] = pinned_bytes_held()
    train(model, optimizer, case, FOLLOW_UP_STREAM, manifest["steps_after"], rank.rank, shape)
    result["pinned_after_steps_bytes"] = pinned_bytes_held()
    reference = torch.load(folder / f"reference_rank{rank.rank}.pt", weights_only=False)
    result.update(compare(reference, snapshot(model, optimizer)))
    return result


def _rank_file(out, rank_index):
    return Path(f"{out}.rank{rank_index}")


def _current_file(out, rank_index):
    return Path(f"{out}.current.rank{rank_index}")


def run_load(args, rank, module_file):
    """Load every case of every ``--ckpt-dir``; each rank writes its part next to ``--out``.

    The part is rewritten after every case, and the case under way is named in a marker
    file, so that a job killed by one case (a CUDA error that ends the process) can be
    started again from the next one (see :func:`_load_until_done`): with ``--continue-load``
    the cases already in the part are not run again.
    """
    part = _rank_file(args.out, rank.rank)
    results = {}
    if args.continue_load and part.exists():
        results = json.loads(part.read_text(encoding="utf-8"))
    for root in args.ckpt_dir:
        manifest, cases = _saved_cases(root, rank.world)
        for case in cases:
            key = case.key(rank.world, manifest["save_with"], args.load_with)
            if key in results:
                continue
            _write_json(_current_file(args.out, rank.rank), {"case": key})
            print(f"{time.strftime('%H:%M:%S')} [rank {rank.rank}] load {key}", flush=True)
            result = {}

            def built(so_far, key=key):
                # Marked unfinished: a restart after the process died keeps these figures.
                results[key] = dict(so_far, case=key, unfinished=True)
                _write_json(part, results)

            try:
                load_one(case, Path(root) / case.name, args, rank, manifest, result, built)
            except Exception as error:  # pylint: disable=broad-except
                result["error"] = _error_text(error)
                print(f"[rank {rank.rank}] load {key} failed: {result['error']}", flush=True)
            result.update(
                case=key,
                world=rank.world,
                dtype=case.dtype,
                offload=case.offload,
                format=case.fmt,
                optimizer=case.optimizer,
                save_with=manifest["save_with"],
                load_with=args.load_with,
                module_files={"save": manifest["module_file"], "load": module_file},
            )
            results[key] = result
            _write_json(part, results)
            _release()
    _current_file(args.out, rank.rank).unlink(missing_ok=True)
    rank.barrier()
    if rank.rank == 0:
        merged = merge_rank_files(args.out, rank.world)
        _write_json(args.out, merged)


# --------------------------------------------------------------------------- merging, driving


def _merge_case(parts):
    """One case's result from each rank's part: exact only if every rank was exact."""
    merged = dict(parts[0])
    errors = [part.get("error") for part in parts if part.get("error")]
    merged["error"] = errors[0] if errors else None
    for flag in ("params_exact", "state_exact", "common_equal"):
        merged[flag] = all(part.get(flag, False) for part in parts)
    merged["exact"] = not errors and merged["params_exact"] and merged["state_exact"]
    for figure in (
        "max_abs_diff",
        "pinned_cold_bytes",
        "pinned_after_load_bytes",
        "pinned_after_steps_bytes",
        "load_peak_gpu_extra_bytes",
        "load_seconds",
    ):
        values = [part[figure] for part in parts if figure in part]
        merged[figure] = max(values) if values else None
    merged["per_rank"] = [
        {
            k: part.get(k)
            for k in (
                "pinned_cold_bytes",
                "pinned_after_load_bytes",
                "pinned_after_steps_bytes",
                "error",
            )
        }
        for part in parts
    ]
    # Per-rank figures by name (phases, kinds of state): the largest rank's.
    for figures in (
        "load_phase_peak_gpu_extra_bytes",
        "load_phase_after_gpu_extra_bytes",
        "optimizer_state_bytes",
    ):
        found = [part.get(figures) or {} for part in parts]
        merged[figures] = {
            name: max(each[name] for each in found if name in each)
            for name in dict.fromkeys(name for each in found for name in each)
        }
    for first_rank_only in ("inner_optimizer", "inner_settings", "fused_adam_load_plans"):
        merged[first_rank_only] = parts[0].get(first_rank_only)
    merged["mismatches"] = [m for part in parts for m in part.get("mismatches", [])][:20]
    return merged


def merge_rank_files(out, world):
    """Merge the ``<out>.rank<r>`` files every rank of a load job wrote."""
    parts = []
    for index in range(world):
        path = _rank_file(out, index)
        parts.append(json.loads(path.read_text(encoding="utf-8")) if path.exists() else {})
    keys = sorted(set().union(*parts))
    merged = {}
    for key in keys:
        present = [part[key] for part in parts if key in part]
        if len(present) < world:
            present[0] = dict(present[0], error=f"only {len(present)} of {world} ranks reported")
        merged[key] = _merge_case(present)
    return merged


def _launch(role, implementation, nproc, extra, log_path, timeout, devices=None):
    """One torchrun job of this file; returns its exit code (its output goes to ``log_path``).

    ``devices``: the GPUs the job may see (CUDA_VISIBLE_DEVICES), or None for all.
    """
    env = dict(os.environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if implementation == "upstream":
        env["MEGATRON_OPTIMIZER_FORK"] = "0"
    else:
        env.pop("MEGATRON_OPTIMIZER_FORK", None)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(__file__).resolve()),
        f"--{role}-with",
        implementation,
        *extra,
    ]
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            done = subprocess.run(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return "timeout"
    return done.returncode


def _log_tail(path, lines=3):
    """The last error lines of a job's log (its last lines if none), on one line.

    C++ stack frames and the launcher's own report are left out: they name no cause.
    """
    try:
        text = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return f"(no log at {path})"
    errors = [
        line
        for line in text
        if ("Error" in line or "Exception" in line)
        and not line.lstrip().startswith("frame #")
        and "ChildFailedError" not in line
    ]
    picked = [line.strip() for line in (errors or text)[-lines:]]
    return " / ".join(picked) + f" (log: {path})"


def _load_until_done(job, nproc, timeout, code):
    """Start a load job again after it died, from the case after the one it died in.

    That case gets an error naming the exit code and the log's last error lines in each rank's
    part that has no result for it yet, so the next start skips it. Stops when the job exits
    cleanly, or when a start names no case or the same case as before (nothing left to skip).

    Args:
        job: ``(role, implementation, extra, log)`` as for :func:`_launch`; ``extra`` holds
            ``--out``.
        nproc: ranks of the job.
        timeout: seconds per start.
        code: exit code of the first start.

    Returns:
        The exit code of the last start.
    """
    role, implementation, extra, log = job
    out = extra[extra.index("--out") + 1]
    extra = [*extra, "--continue-load"]
    crashed = set()
    attempt = 0
    while code not in (0, "timeout"):  # a hung case would hang again: no restart
        markers = [_current_file(out, index) for index in range(nproc)]
        names = {json.loads(m.read_text(encoding="utf-8"))["case"] for m in markers if m.exists()}
        if len(names) != 1 or names & crashed:
            return code
        key = names.pop()
        crashed.add(key)
        error = f"the load job died in this case (exit {code}): {_log_tail(log)}"
        for index in range(nproc):
            part = _rank_file(out, index)
            results = json.loads(part.read_text(encoding="utf-8")) if part.exists() else {}
            # A case whose result was written died in the clean-up after it: keep the result.
            # An unfinished one keeps what it measured before the load and gets the error.
            if results.get(key, {"unfinished": True}).get("unfinished"):
                results[key] = dict(results.get(key, {}), error=error)
            _write_json(part, results)
        attempt += 1
        log = Path(f"{job[3]}.restart{attempt}")
        print(f"load job of {implementation} died in {key}; restarting after it", flush=True)
        code = _launch(role, implementation, nproc, extra, log, timeout)
    return code


def _visible_devices():
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES entries."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [entry.strip() for entry in visible.split(",") if entry.strip()]
    return [str(index) for index in range(torch.cuda.device_count())]


def _run_side_by_side(jobs, nproc, timeout, side_by_side):
    """Run ``jobs`` (``(role, implementation, extra, log)``), each on ``nproc`` GPUs of its own
    at the same time where there are enough GPUs and ``side_by_side``, else one after the
    other; their exit codes, in order."""
    devices = _visible_devices()
    if not side_by_side or len(jobs) < 2 or len(jobs) * nproc > len(devices):
        return [_launch(*job[:2], nproc, *job[2:], timeout) for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(
                _launch, *job[:2], nproc, *job[2:], timeout, devices[i * nproc : (i + 1) * nproc]
            )
            for i, job in enumerate(jobs)
        ]
        return [future.result() for future in futures]


def drive(
    cases,
    pairs,
    nproc,
    steps_before=3,
    steps_after=2,
    workdir=None,
    timeout=1200,
    side_by_side=True,
    **settings,
):
    """Run every (save_with, load_with) pair over ``cases`` with the fewest torchrun jobs.

    One save job per saving implementation and one load job per loading implementation (it
    reads every checkpoint folder it needs): the save jobs first, then the load jobs, the jobs
    of each phase side by side on GPUs of their own where there are enough and
    ``side_by_side`` (pass False when timings are compared across implementations).

    Settings: ``shape`` (:class:`Shape` of the probe, default the small one),
    ``collective_timeout`` (seconds a rank waits in a collective; a rank left behind by
    another's error costs that long), ``log_dir`` (where the jobs' logs are copied at the end;
    the checkpoints stay in ``workdir``).

    Returns:
        dict: ``Case.key(nproc, save_with, load_with)`` -> merged result; a job that failed
        leaves an ``error`` with the tail of its log in each of its cases. A case this machine
        cannot run (see :func:`te_unavailable`) is not started: its results only carry
        ``skipped`` (the reason) and ``exact`` False.
    """
    results = {}
    skipped = {case: te_unavailable(case) for case in cases}
    for case, reason in skipped.items():
        for save, load in pairs if reason else ():
            key = case.key(nproc, save, load)
            results[key] = {"case": key, "skipped": reason, "error": None, "exact": False}
    cases = [case for case in cases if not skipped[case]]
    if not cases:
        return results
    owned = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="distopt_resume_") if owned else workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    names = [case.name for case in cases]
    shape = settings.get("shape") or Shape()
    common = ["--collective-timeout", str(settings.get("collective_timeout") or 300)]
    save_failures = {}
    try:
        savers = sorted({save for save, _ in pairs})
        save_jobs = []
        for save in savers:
            extra = ["--ckpt-dir", str(workdir / f"saved_by_{save}"), "--cases", *names]
            extra += ["--steps-before", str(steps_before), "--steps-after", str(steps_after)]
            extra += ["--hidden", str(shape.hidden), "--ffn", str(shape.ffn), *common]
            save_jobs.append(("save", save, extra, workdir / f"save_{save}.log"))
        for job, code in zip(save_jobs, _run_side_by_side(save_jobs, nproc, timeout, side_by_side)):
            if code != 0:
                save_failures[job[1]] = f"save job exited {code}: {_log_tail(job[3])}"

        loaders = sorted({load for _, load in pairs})
        sources = {load: [saver for saver, loader in pairs if loader == load] for load in loaders}
        load_jobs = []
        for load in loaders:
            readable = [
                saver
                for saver in sources[load]
                if (workdir / f"saved_by_{saver}" / MANIFEST).exists()
            ]
            if readable:
                out = workdir / f"loaded_by_{load}.json"
                for stale in [out, *workdir.glob(f"{out.name}.*")]:
                    stale.unlink(missing_ok=True)
                extra = ["--ckpt-dir", *(str(workdir / f"saved_by_{saver}") for saver in readable)]
                extra += ["--out", str(out), *common]
                load_jobs.append(("load", load, extra, workdir / f"load_{load}.log"))
        first_codes = _run_side_by_side(load_jobs, nproc, timeout, side_by_side)
        codes = {
            job[1]: _load_until_done(job, nproc, timeout, code) if code != 0 else 0
            for job, code in zip(load_jobs, first_codes)
        }
        for load in loaders:
            merged, code, log = {}, codes.get(load), workdir / f"load_{load}.log"
            if load in codes:
                out = workdir / f"loaded_by_{load}.json"
                merged = (
                    json.loads(out.read_text(encoding="utf-8"))
                    if out.exists()
                    else merge_rank_files(out, nproc)
                )
            for case, save in itertools.product(cases, sources[load]):
                key = case.key(nproc, save, load)
                result = merged.get(key) or {"case": key, "error": "no result"}
                problems = [save_failures.get(save), result.get("error")]
                if code not in (None, 0):
                    problems.append(f"load job exited {code}: {_log_tail(log)}")
                result["error"] = " | ".join(p for p in problems if p) or None
                result["exact"] = bool(result.get("exact")) and not result["error"]
                results[key] = result
    finally:
        if settings.get("log_dir"):
            logs = Path(settings["log_dir"])
            logs.mkdir(parents=True, exist_ok=True)
            for log in workdir.glob("*.log*"):
                shutil.copyfile(log, logs / log.name)
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
    return results


def with_controls(pairs):
    """``pairs`` plus the upstream2upstream control wherever upstream loads a fork checkpoint."""
    pairs = list(dict.fromkeys(pairs))
    if ("fork", "upstream") in pairs and CONTROL_PAIR not in pairs:
        pairs.append(CONTROL_PAIR)
    return pairs


def control_failure(results, key):
    """Why megatron-core 0.19.2 itself stands in the way of result ``key``, or None.

    A ``...-fork2upstream`` result is excused when the upstream2upstream control of its case
    fails too (upstream cannot resume its own checkpoint of that case). A
    ``...-upstream2fork`` result is excused only when upstream failed to train and save the
    checkpoint (there is nothing for the fork to load); any failure of the fork's load counts.

    Args:
        results: what :func:`drive` returned (with the control pair among its pairs).
        key: a result id.

    Returns:
        str or None: upstream's error or first mismatches; None when nothing excuses the result.
    """
    if key.endswith("-upstream2fork"):
        error = results.get(key, {}).get("error") or ""
        if error.startswith(("save failed", "save job exited")):
            return f"upstream 0.19.2 cannot write this checkpoint: {error[:300]}"
        return None
    if not key.endswith("-fork2upstream"):
        return None
    control = results.get(key[: -len("fork2upstream")] + "upstream2upstream")
    if control is None or control.get("skipped"):
        return None
    if control.get("exact") and control.get("common_equal", True):
        return None
    if control.get("error"):
        return f"upstream2upstream fails too: {control['error'][:300]}"
    found = "; ".join(control.get("mismatches", [])[:3])
    return f"upstream2upstream fails too (max |diff| {control.get('max_abs_diff')}): {found}"


# --------------------------------------------------------------------------- command line


def _mib(value):
    return "-" if value is None else f"{value / 2**20:.2f}"


def report(results):
    """One line per case: exactness and the memory/time figures (a skipped case: why)."""
    width = max([58, *map(len, results)])
    header = (
        f"{'case':{width}} {'exact':>5} {'max|diff|':>9} {'pin cold':>8} {'pin load':>8} "
        f"{'pin step':>8} "
        f"{'peak+GPU':>8} {'load s':>7}  (MiB)"
    )
    print(header)
    for key in sorted(results):
        item = results[key]
        if item.get("skipped"):
            print(f"{key:{width}} skipped: {item['skipped']}")
            continue
        diff = item.get("max_abs_diff")
        seconds = item.get("load_seconds")
        print(
            f"{key:{width}} {'yes' if item.get('exact') else 'NO':>5} "
            f"{'-' if diff is None else f'{diff:.3g}':>9} "
            f"{_mib(item.get('pinned_cold_bytes')):>8} "
            f"{_mib(item.get('pinned_after_load_bytes')):>8} "
            f"{_mib(item.get('pinned_after_steps_bytes')):>8} "
            f"{_mib(item.get('load_peak_gpu_extra_bytes')):>8} "
            f"{'-' if seconds is None else f'{seconds:.3f}':>7}"
            + ("  primed" if item.get("primed") else "")
            + (
                f"  [{item['inner_optimizer'].rsplit('.', 1)[-1]}]"
                if item.get("inner_optimizer")
                else ""
            )
        )
        for plan in dict.fromkeys(item.get("fused_adam_load_plans") or []):
            print(f"    load path: {plan[:300]}")
        if item.get("upstream_fails_too"):
            print(f"    not the fork's: {item['upstream_fails_too'][:400]}")
        if item.get("error"):
            print(f"    error: {item['error'][:400]}")
        for mismatch in item.get("mismatches", [])[:3]:
            print(f"    {mismatch}")


def selected_cases(args):
    """``--cases`` if given, else every combination of ``--dtype``, ``--offload-fraction``,
    ``--format`` and ``--optimizer``."""
    if args.cases:
        return [Case.parse(name) for name in args.cases]
    return product(args.dtype, args.offload_fraction, args.format, args.optimizer)


def parse_args(argv=None):
    """Command-line options; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-with", choices=IMPLEMENTATIONS)
    parser.add_argument("--load-with", choices=IMPLEMENTATIONS)
    parser.add_argument("--ckpt-dir", nargs="+", help="checkpoint folder(s); one to save into")
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=["bf16"])
    parser.add_argument("--offload-fraction", nargs="+", type=float, default=[0.5])
    parser.add_argument("--format", nargs="+", choices=FORMATS, default=["dp_reshardable"])
    parser.add_argument(
        "--optimizer",
        nargs="+",
        choices=OPTIMIZERS,
        default=["default"],
        help="inner-optimizer variant(s); all but default need Transformer Engine, no offload",
    )
    parser.add_argument(
        "--cases", nargs="+", help="explicit case names (e.g. bf16-off0.5-legacy) instead"
    )
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="probe width (save side)")
    parser.add_argument("--ffn", type=int, default=FFN, help="probe inner width (save side)")
    parser.add_argument("--steps-before", type=int, default=3)
    parser.add_argument("--steps-after", type=int, default=2)
    parser.add_argument("--out", help="result JSON (load side, or both sides)")
    parser.add_argument(
        "--continue-load",
        action="store_true",
        help="restart of a load job that died: keep the cases already in its rank parts",
    )
    parser.add_argument(
        "--nproc-per-node", type=int, default=1, help="ranks when this script starts torchrun"
    )
    parser.add_argument(
        "--prime",
        choices=("auto", "never", "always"),
        default="auto",
        help="materialise optimizer state before a dist-checkpoint load (auto: upstream only)",
    )
    parser.add_argument("--collective-timeout", type=int, default=300)
    args = parser.parse_args(argv)
    for fraction in args.offload_fraction:
        if fraction not in OFFLOAD_FRACTIONS:
            parser.error(f"--offload-fraction {fraction}: choose from {OFFLOAD_FRACTIONS}")
    if not (args.save_with or args.load_with):
        parser.error("name --save-with, --load-with, or both")
    try:
        selected_cases(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv=None):
    """Entry point for both the torchrun workers and the two-sided driver."""
    args = parse_args(argv)
    under_torchrun = "LOCAL_RANK" in os.environ
    if not under_torchrun:
        if not (args.save_with and args.load_with):
            raise SystemExit("outside torchrun, name both --save-with and --load-with")
        cases = selected_cases(args)
        workdir = args.ckpt_dir[0] if args.ckpt_dir else None
        pair = (args.save_with, args.load_with)
        results = drive(
            cases,
            with_controls([pair]),
            args.nproc_per_node,
            args.steps_before,
            args.steps_after,
            workdir,
            shape=Shape(args.hidden, args.ffn),
            collective_timeout=args.collective_timeout,
        )
        for key, result in results.items():
            result["upstream_fails_too"] = control_failure(results, key)
        report(results)
        if args.out:
            _write_json(args.out, results)
        # The control only excuses its fork2upstream counterpart; it is not judged itself.
        # A skipped case is not judged either; with nothing judged the run is not a pass.
        judged = [
            result
            for key, result in results.items()
            if key.endswith(f"-{pair[0]}2{pair[1]}")
            and not result["upstream_fails_too"]
            and not result.get("skipped")
        ]
        return 0 if judged and all(r.get("exact") for r in judged) else 1
    if bool(args.save_with) == bool(args.load_with) or not args.ckpt_dir:
        raise SystemExit(
            "under torchrun, name exactly one of --save-with/--load-with and --ckpt-dir"
        )
    if args.load_with and not args.out:
        raise SystemExit("--load-with needs --out")
    module_file = _select_implementation(args.save_with or args.load_with)
    rank = Rank(args.collective_timeout)
    try:
        if args.save_with:
            run_save(args, rank, module_file)
        else:
            run_load(args, rank, module_file)
    finally:
        Rank.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
