# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""What one rank of a multi-rank world does: build what Megatron builds, train on data that is
the same on every rank, save and load every format, and compare with the uninterrupted run.

With the same gradients on every rank and no clipping, Adam is elementwise: the run does not
depend on the data-parallel size, so a checkpoint saved at one size and loaded at another must
give the uninterrupted run bit for bit. :func:`model_space_state` gives a rank's optimizer state
by parameter (padding stripped), which a resharded load must reproduce element for element.
"""

import contextlib
import dataclasses
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from .cases import FFN, HIDDEN, Case
from .measure import optimizer_state_bytes
from .snapshots import compare, snapshot
from .worker import (
    distributed_optimizers,
    load_checkpoint,
    needs_priming,
    prime,
    save_checkpoint,
    train_step,
    wrap_for_training,
)

BATCH = 4
BUCKET_SIZE = 2000
STEPS_BEFORE, STEPS_AFTER = 2, 2
TRAIN_STREAM, FOLLOW_UP_STREAM = 1, 2
SAVE_SEED, LOAD_SEED, OTHER_MODEL_SEED = 1, 7, 11
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
RECORD = "model_space.pt"
# torch's CheckpointException, which dist_checkpointing raises for a failed read or write,
# derives from BaseException.
FAILURES = (Exception, CheckpointException)


@dataclasses.dataclass(frozen=True)
class Cell:
    """A configuration of the matrix: a :class:`~resume_harness.cases.Case` and whether the
    model has expert parameters (a second, expert-data-parallel optimizer).

    Attributes:
        case: dtype, offload fraction, format (optimizer kind ``default``).
        experts: add expert parameters (``allreduce=False``), so that Megatron chains a dense
            and an expert DistributedOptimizer, each with its own inner optimizer.
    """

    case: Case
    experts: bool = False

    @property
    def name(self):
        """e.g. ``bf16-off0.5-fully_reshardable`` or ``fp32-off0-legacy-experts``."""
        return self.case.name + ("-experts" if self.experts else "")

    @property
    def family(self):
        """The name without the format: cells of one family share the uninterrupted run."""
        return (self.case.dtype, self.case.offload, self.experts)

    @property
    def dtype(self):
        """The parameters' torch dtype."""
        return torch.bfloat16 if self.case.dtype == "bf16" else torch.float32


def _probe_class():
    from megatron.core.transformer.module import (  # pylint: disable=import-outside-toplevel
        MegatronModule,
    )

    class MultirankProbe(MegatronModule):
        """Two linear layers and a norm; with experts, a third layer whose parameters are
        expert parameters (reduced over the expert-data-parallel group)."""

        def __init__(self, config, experts):
            super().__init__(config)
            self.inp = torch.nn.Linear(HIDDEN, FFN)
            self.out = torch.nn.Linear(FFN, HIDDEN, bias=False)
            self.norm = torch.nn.LayerNorm(HIDDEN)
            self.expert = torch.nn.Linear(HIDDEN, HIDDEN) if experts else None
            if experts:
                for param in self.expert.parameters():
                    param.allreduce = False

        def forward(self, x):  # pylint: disable=missing-function-docstring
            hidden = self.out(torch.nn.functional.gelu(self.inp(x)))
            if self.expert is not None:
                hidden = hidden + torch.tanh(self.expert(x))
            return self.norm(hidden + x)

    return MultirankProbe


def build(cell, seed, device, hidden_shift=0):
    """The DDP-wrapped probe and the optimizer ``get_megatron_optimizer`` builds for ``cell``.

    Args:
        cell: the configuration.
        seed: initialisation seed (the same on every rank).
        device: ``"cpu"`` or ``"cuda"``.
        hidden_shift: widen the first layer (``OTHER_MODEL_SEED`` runs: another model).
    """
    # pylint: disable=import-outside-toplevel
    from megatron.core.transformer import TransformerConfig

    bf16 = cell.case.dtype == "bf16"
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, bf16=bf16, params_dtype=cell.dtype
    )
    module = _probe_class()(config, cell.experts)
    if hidden_shift:
        module.inp = torch.nn.Linear(HIDDEN, FFN + hidden_shift)
        module.out = torch.nn.Linear(FFN + hidden_shift, HIDDEN, bias=False)
    module = module.to(device=device, dtype=cell.dtype)
    model, optimizer = wrap_for_training(
        config, module, cell.case, BUCKET_SIZE, lr=1e-2, clip_grad=0.0
    )
    _check_inner_optimizers(cell, optimizer)
    return model, optimizer


def _check_inner_optimizers(cell, optimizer):
    """Megatron must have built the inner optimizer the cell stands for: the
    HybridDeviceOptimizer with offload, torch AdamW without (no TE or Apex on these hosts)."""
    wanted = "HybridDeviceOptimizer" if cell.case.offload > 0 else "AdamW"
    built = [type(dist.optimizer).__name__ for dist in distributed_optimizers(optimizer)]
    if any(name != wanted for name in built) or len(built) != 1 + cell.experts:
        raise RuntimeError(f"{cell.name}: Megatron built {built}, expected {wanted}")


def train(model, optimizer, cell, stream, steps, device):
    """``steps`` optimizer steps on data fixed by (stream, step), the same on every rank."""
    for step in range(steps):
        generator = torch.Generator().manual_seed(1_000_003 * stream + 1_009 * step)
        inputs = torch.randn((BATCH, HIDDEN), generator=generator).to(device, cell.dtype)
        target = torch.randn((BATCH, HIDDEN), generator=generator).to(device, cell.dtype)
        train_step(model, optimizer, inputs, target)


def _step_of(dist, model_param):
    """The Adam step count of ``model_param``'s shard: in its state (torch) or its group."""
    group_index, order = dist.model_param_group_index_map[model_param]
    group = dist.optimizer.param_groups[group_index]
    step = dist.optimizer.state.get(group["params"][order], {}).get("step", group.get("step"))
    return None if step is None else float(step)


def local_pieces(model, optimizer):
    """This rank's optimizer state by parameter: ``{"<optimizer>/<name>": (start, end,
    {key: tensor}, step)}`` for each owned piece of a parameter (padding never included)."""
    names = {param: name for name, param in model.named_parameters()}
    pieces = {}
    for index, dist in enumerate(distributed_optimizers(optimizer)):
        for param in dist.model_param_group_index_map:
            piece = dist._get_model_param_range_map(param)["param"]  # pylint: disable=W0212
            state = dist._get_main_param_and_optimizer_states(param)  # pylint: disable=W0212
            tensors = {key: state[key].detach().float().cpu().clone() for key in STATE_KEYS}
            pieces[f"{index}/{names[param]}"] = (
                piece.start,
                piece.end,
                tensors,
                _step_of(dist, param),
            )
    return pieces


def model_space_state(model, optimizer):
    """Every parameter's whole optimizer state, assembled from every rank's pieces (a
    collective): ``{"<optimizer>/<name>": {key: flat fp32 tensor, "step": float}}``."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, local_pieces(model, optimizer))
    sizes = {name: param.numel() for name, param in model.named_parameters()}
    whole = {}
    for pieces in everyone:
        for key, (start, end, tensors, step) in pieces.items():
            entry = whole.setdefault(
                key, {name: torch.zeros(sizes[key.split("/", 1)[1]]) for name in STATE_KEYS}
            )
            for name, tensor in tensors.items():
                entry[name][start:end] = tensor
            entry["step"] = step
    return whole


def model_space_mismatches(model, optimizer, record):
    """Where this rank's state differs from a saved :func:`model_space_state`."""
    found = []
    for key, (start, end, tensors, step) in local_pieces(model, optimizer).items():
        saved = record.get(key)
        if saved is None:
            found.append(f"{key}: not in the saved state")
            continue
        for name, tensor in tensors.items():
            if not torch.equal(tensor, saved[name][start:end]):
                found.append(f"{key}[{name}][{start}:{end}] differs")
        if step != saved["step"]:
            found.append(f"{key}: step {step} != saved {saved['step']}")
    return found


class _NoPeaks:
    """The load's phases, unmeasured (the memory figures belong to the GPU harness)."""

    @staticmethod
    def phase(name):  # pylint: disable=missing-function-docstring
        del name
        return contextlib.nullcontext()


def checkpoint_folder(root, tag, cell):
    """Where the world with cell-key prefix ``tag`` (e.g. ``fork-dp4``) keeps ``cell``'s
    checkpoint."""
    return Path(root) / tag / cell.name


def save(cell, model, optimizer, folder, world):
    """Write ``cell``'s checkpoint and its model-space record into ``folder``."""
    if world.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    world.barrier()
    save_checkpoint(cell.case, model, optimizer, folder, world)
    record = model_space_state(model, optimizer)
    if world.rank == 0:
        torch.save(record, folder / RECORD)
    world.barrier()


def load(cell, model, optimizer, folder, implementation):
    """Read ``cell``'s checkpoint from ``folder`` the way Megatron-LM does."""
    if needs_priming(cell.case, implementation, optimizer, "auto"):
        prime(optimizer)
    load_checkpoint(cell.case, model, optimizer, folder, _NoPeaks())


def host_state_bytes(optimizer):
    """Host memory this rank's optimizers hold for their state: their state tensors on the
    host (each storage once) and, where CUDA exists, the pinned memory in use."""
    found = optimizer_state_bytes(optimizer)["host_all"]
    if torch.cuda.is_available():
        found += torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
    return found


def reference_snapshot(model, optimizer):
    """The uninterrupted run's snapshot, with the host memory its state took from its cold
    start on (``host_bytes``), which no load may exceed."""
    found = snapshot(model, optimizer)
    found["host_bytes"] = host_state_bytes(optimizer)
    return found


def load_memory_result(reference, optimizer):
    """None when the host memory of the loaded state is no more than the uninterrupted run's."""
    loaded = host_state_bytes(optimizer)
    if loaded <= reference["host_bytes"]:
        return None
    return (
        f"the load holds {loaded} bytes of host memory for the optimizer state, the "
        f"uninterrupted run {reference['host_bytes']}"
    )


def resume_result(reference, model, optimizer):
    """Compare a resumed run with the uninterrupted one; None when bit-exact."""
    result = compare(reference, snapshot(model, optimizer))
    if result["params_exact"] and result["state_exact"] and result["common_equal"]:
        return None
    return f"not bit-exact: {result['mismatches'][:4]} {result['common_differences'][:4]}"
