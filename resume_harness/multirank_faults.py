# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Faults injected into a multi-rank world, one cell per fault and format.

Each fault trains a source run (offload 0.5: the HybridDeviceOptimizer), saves it, goes on (the
reference), and loads a damaged checkpoint into a target that has trained a step of its own:

The damaged checkpoint's optimizer part is read alone (a model part of another shape would be
refused by dist_checkpointing itself, and the intact model part of the others would change the
parameters legitimately).

``other-model``
    a checkpoint of a model with another layer width: every rank raises, the target's
    parameters and state are unchanged and it still steps and saves.
``truncated``
    the legacy parameter-state file (read by rank 0) cut in half: every rank raises.
``nonfinite``
    a NaN in one parameter's saved ``exp_avg`` (legacy file): every rank raises.
``write``
    a failure on data-parallel rank 1 while the checked state is written: every rank raises
    and refuses to step and to save until a complete load, which then resumes the reference
    exactly.

A legacy load is two calls: ``load_state_dict`` writes the checkpoint's groups and steps, then
``load_parameter_state`` checks and writes the file. Where the second refuses, every rank
refuses to step and to save until a complete load instead of going on unchanged.

After each fault the target loads the intact checkpoint, trains on, and must equal the
reference bit for bit.
"""

import traceback

import torch

from . import table
from .cases import Case
from .multirank_rank import (
    FAILURES,
    FOLLOW_UP_STREAM,
    LOAD_SEED,
    OTHER_MODEL_SEED,
    SAVE_SEED,
    STEPS_AFTER,
    STEPS_BEFORE,
    TRAIN_STREAM,
    Cell,
    build,
    load,
    resume_result,
    save,
)
from .snapshots import compare, snapshot
from .worker import distributed_optimizers

FAULT_OFFLOAD = 0.5
FAULTY_RANK = 1
FAULT_FORMATS = {
    "other-model": tuple(table.format_names(round_trips=True)),
    # A dist-checkpoint file cut short fails the read on its rank alone: dist_checkpointing
    # does not tell the other ranks, which wait for it in the optimizer's agreement.
    "truncated": ("legacy",),
    "nonfinite": ("legacy",),
    "write": tuple(table.format_names(round_trips=True)),
}
"""Fault name -> the formats it is injected into."""


class InjectedWriteFault(RuntimeError):
    """The failure injected while a rank writes a checked state."""


def fault_keys(tag, faults):
    """The verdict keys the faults of a world with cell-key prefix ``tag`` produce."""
    return [f"{tag}-fault-{fault}-{fmt}" for fault in faults for fmt in FAULT_FORMATS[fault]]


def _folder(root, tag, name):
    return root / "faults" / tag / name


def _optimizer_only_load(cell, model, optimizer, folder):
    """Read the optimizer part of a checkpoint alone, through the calls Megatron-LM makes."""
    if cell.case.fmt == "legacy":
        common = torch.load(folder / "common.pt", map_location="cpu", weights_only=False)
        optimizer.load_state_dict(common["optimizer"])
        optimizer.load_parameter_state(str(folder / "param_state.pt"))
        return
    from megatron.core import dist_checkpointing  # pylint: disable=import-outside-toplevel

    metadata = {"distrib_optim_sharding_type": cell.case.fmt}
    model_sd = model.sharded_state_dict()
    request = {
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
    }
    loaded = dist_checkpointing.load(request, str(folder / "dist"))
    optimizer.load_state_dict(loaded["optimizer"])


def _damage(fault, cell, folder, world):
    """Damage ``folder``'s checkpoint as ``fault`` says (rank 0 writes, every rank waits)."""
    if world.rank == 0:
        if cell.case.fmt == "legacy":
            path = folder / "param_state.pt"
        else:
            path = folder / "dist" / f"__{FAULTY_RANK}_0.distcp"
        if fault == "truncated":
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        elif fault == "nonfinite":
            state = torch.load(path, weights_only=False)
            tensors = next(iter(state[0].values()))
            tensors["exp_avg"][0] = float("nan")
            torch.save(state, path)
    world.barrier()


def _refuses(world, optimizer, model, cell, folder):
    """Problems unless the target refuses to step and to save (a pending load)."""
    problems = []
    for action, attempt in (
        ("step", optimizer.step),
        ("save", lambda: save(cell, model, optimizer, folder / "refused", world)),
    ):
        try:
            attempt()
        except FAILURES:  # pylint: disable=broad-exception-caught
            continue
        problems.append(f"the half-loaded optimizer did not refuse to {action}")
    return problems


def _one(fault, world, spec, root, fmt):
    """Inject ``fault`` into format ``fmt``; None when every expectation held on this rank."""
    cell = Cell(Case("bf16", FAULT_OFFLOAD, fmt))
    device, tag = spec.device, spec.tag
    source = _folder(root, tag, f"{fault}-{fmt}")
    model, optimizer = build(cell, SAVE_SEED, device)
    train(model, optimizer, cell, TRAIN_STREAM, STEPS_BEFORE, device)
    save(cell, model, optimizer, source, world)
    train(model, optimizer, cell, FOLLOW_UP_STREAM, STEPS_AFTER, device)
    reference = snapshot(model, optimizer)

    damaged = source
    if fault == "other-model":
        damaged = _folder(root, tag, f"other-{fmt}")
        other, other_optimizer = build(cell, OTHER_MODEL_SEED, device, hidden_shift=8)
        train(other, other_optimizer, cell, TRAIN_STREAM, 1, device)
        save(cell, other, other_optimizer, damaged, world)
    elif fault in ("truncated", "nonfinite"):
        damaged = _folder(root, tag, f"{fault}-{fmt}-damaged")
        save(cell, model, optimizer, damaged, world)  # any intact state, then damaged
        _damage(fault, cell, damaged, world)

    target, target_optimizer = build(cell, LOAD_SEED, device)
    train(target, target_optimizer, cell, TRAIN_STREAM, 1, device)
    before = snapshot(target, target_optimizer)
    if fault == "write" and world.rank == FAULTY_RANK:
        _fail_a_write(target_optimizer)
    problems = []
    try:
        _optimizer_only_load(cell, target, target_optimizer, damaged)
    except FAILURES:  # pylint: disable=broad-exception-caught
        pass
    else:
        if fault != "write" or world.rank == FAULTY_RANK:
            problems.append("the faulty checkpoint was loaded")
    world.barrier()
    if fault == "write" or cell.case.fmt == "legacy":
        # The state is partly the checkpoint's: a rank failed while writing, or (legacy, two
        # calls) load_state_dict wrote the checkpoint's groups and steps before
        # load_parameter_state refused its file.
        problems += _refuses(world, target_optimizer, target, cell, source)
    else:
        unchanged = compare(before, snapshot(target, target_optimizer))
        if not (unchanged["params_exact"] and unchanged["state_exact"]):
            problems.append(f"the refused load changed the target: {unchanged['mismatches'][:3]}")
        else:
            # Refused before anything was written: the target goes on as if nothing happened.
            train(target, target_optimizer, cell, FOLLOW_UP_STREAM, 1, device)
    for dist in distributed_optimizers(target_optimizer):
        dist.__dict__.pop("_set_main_param_and_optimizer_states", None)
    world.barrier()
    load(cell, target, target_optimizer, source, spec.implementation)
    train(target, target_optimizer, cell, FOLLOW_UP_STREAM, STEPS_AFTER, device)
    problem = resume_result(reference, target, target_optimizer)
    if problem:
        problems.append(f"the complete load after the fault: {problem}")
    return "; ".join(problems) or None


def train(model, optimizer, cell, stream, steps, device):
    """:func:`resume_harness.multirank_rank.train`, named here for the fault bodies."""
    from .multirank_rank import train as train_steps  # pylint: disable=import-outside-toplevel

    train_steps(model, optimizer, cell, stream, steps, device)


def _fail_a_write(optimizer):
    """Make this rank's writes of parameter state fail: the second where there are several, so
    that one went through, else the one (a rank of a large world may own a single piece)."""
    for dist in distributed_optimizers(optimizer):
        setter = dist._set_main_param_and_optimizer_states  # pylint: disable=protected-access
        pieces = sum(len(group["params"]) for group in dist.optimizer.param_groups)
        calls = []

        def failing(model_param, tensors, setter=setter, calls=calls, failing_call=min(2, pieces)):
            calls.append(model_param)
            if len(calls) == failing_call:
                raise InjectedWriteFault("injected failure while writing a parameter's state")
            return setter(model_param, tensors)

        dist._set_main_param_and_optimizer_states = failing  # pylint: disable=protected-access


def run(fault, world, spec, root):
    """Every format of ``fault`` in this world: ``{verdict key: None or error}``."""
    verdicts = {}
    for fmt in FAULT_FORMATS[fault]:
        with open(
            root / "results" / f"{spec.tag}-rank{world.rank}.log", "a", encoding="utf-8"
        ) as log:
            log.write(f"{fault} {fmt}\n")
        try:
            verdicts[f"{spec.tag}-fault-{fault}-{fmt}"] = _one(fault, world, spec, root, fmt)
        except FAILURES as error:  # pylint: disable=broad-exception-caught
            verdicts[f"{spec.tag}-fault-{fault}-{fmt}"] = (
                f"{type(error).__name__}: {error} | {traceback.format_exc()[-600:]}"
            )
        world.barrier()
    return verdicts
