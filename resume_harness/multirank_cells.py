# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The cells a rank of a spawned world runs, in order, and their verdicts.

For each family of cells (dtype, offload fraction, experts) one uninterrupted run trains, saves
every format of the family, and goes on; its snapshot is the reference of every cell of the family.
Then, per format: ``resume`` loads this world's checkpoint into a fresh model and optimizer, trains
on and compares; ``from-dp<M>`` loads what a world of data-parallel size M saved
(``from-<impl>-dp<M>``: a world of another version of the fork), at this world's size as a resume,
at another size as follows: a format that reshards must give the saved state in model space element
for element and then the uninterrupted run; a format that cannot must be refused, naming both sizes,
with nothing changed (in the fork every format of :data:`RESHARDING_FORMATS` reshards, so this path
serves a format added later). Faults (:mod:`resume_harness.multirank_faults`) run last.

Every verdict is None (passed) or the error text; a cell's exception does not end the rank, but
a collective left half-done by one rank can hang the others until the world's timeout.
"""

import itertools
import traceback

import torch

from . import multirank_faults, table
from .multirank_rank import (
    FAILURES,
    FOLLOW_UP_STREAM,
    LOAD_SEED,
    RECORD,
    SAVE_SEED,
    STEPS_AFTER,
    STEPS_BEFORE,
    TRAIN_STREAM,
    build,
    checkpoint_folder,
    load,
    load_memory_result,
    model_space_mismatches,
    reference_snapshot,
    resume_result,
    save,
    train,
)
from .snapshots import compare, snapshot
from .worker import release

# Formats whose checkpoint a world of another data-parallel size must load exactly (every one
# that round-trips); the others must be refused. dp_reshardable keeps each bucket's unpadded
# state whole, so only the data-parallel size (not TP or PP) may change.
RESHARDING_FORMATS = tuple(table.format_names(round_trips=True))


def _error_text(error):
    return f"{type(error).__name__}: {error}".replace("\n", " ")[:1500]


def _verdict(body, *args):
    """Run one cell; None when it passed, else the error (traceback tail included)."""
    try:
        return body(*args)
    except FAILURES as error:  # pylint: disable=broad-exception-caught
        return f"{_error_text(error)} | {traceback.format_exc()[-600:]}"


def _resume(world, spec, cell, folder, reference):
    model, optimizer = build(cell, LOAD_SEED, spec.device)
    load(cell, model, optimizer, folder, spec.implementation)
    problem = load_memory_result(reference, optimizer)
    train(model, optimizer, cell, FOLLOW_UP_STREAM, STEPS_AFTER, spec.device)
    del world
    return problem or resume_result(reference, model, optimizer)


def _reshard(world, spec, cell, folder, reference):
    """A checkpoint of another data-parallel size: the state in model space equals the saved
    one, and training goes on as a run at this size from that state."""
    model, optimizer = build(cell, LOAD_SEED, spec.device)
    load(cell, model, optimizer, folder, spec.implementation)
    record = torch.load(folder / RECORD, weights_only=False)
    differences = model_space_mismatches(model, optimizer, record)
    if differences:
        return f"loaded state differs from the saved one in model space: {differences[:4]}"
    problem = load_memory_result(reference, optimizer)
    if cell.case.dtype == "bf16":
        # fp32 sums of identical bf16 gradients are exact at any size: the uninterrupted run
        # at this size is the run from the saved state.
        expected = reference
    else:
        # Sums of identical fp32 gradients round where the size is not a power of the
        # collective's pairing (gloo at DP 8): the runs at two sizes drift apart by 1e-8.
        expected = _run_again_at_this_size(world, spec, cell, folder, (model, optimizer))
    train(model, optimizer, cell, FOLLOW_UP_STREAM, STEPS_AFTER, spec.device)
    del world
    return problem or resume_result(expected, model, optimizer)


def _run_again_at_this_size(world, spec, cell, loaded_from, run):
    """A run at this size from the state ``run`` (model, optimizer) loaded from ``loaded_from``:
    that state saved here and loaded into a fresh model and optimizer (a same-size resume,
    exact by the resume cells), trained as the resharded run will be; its snapshot."""
    root = loaded_from.parent.parent  # checkpoint_folder's layout: root / tag / cell
    folder = checkpoint_folder(root, f"{spec.tag}-again", cell)
    save(cell, *run, folder, world)
    twin, twin_optimizer = build(cell, LOAD_SEED, spec.device)
    load(cell, twin, twin_optimizer, folder, spec.implementation)
    train(twin, twin_optimizer, cell, FOLLOW_UP_STREAM, STEPS_AFTER, spec.device)
    return snapshot(twin, twin_optimizer)


def _refused(world, spec, cell, folder, saved_size):
    """A checkpoint of another data-parallel size that cannot reshard: refused on every rank,
    naming both sizes, with the optimizer's state and the parameters unchanged."""
    model, optimizer = build(cell, LOAD_SEED, spec.device)
    train(model, optimizer, cell, TRAIN_STREAM, 1, spec.device)
    before = snapshot(model, optimizer)
    try:
        load(cell, model, optimizer, folder, spec.implementation)
    except FAILURES as error:  # pylint: disable=broad-exception-caught
        text = str(error)
        sizes = (str(saved_size), str(world.data_parallel))
        if not all(size in text for size in sizes):
            return f"refused without naming sizes {sizes}: {_error_text(error)}"
    else:
        return "a checkpoint of another data-parallel size was loaded"
    after = compare(before, snapshot(model, optimizer))
    if not (after["params_exact"] and after["state_exact"] and after["common_equal"]):
        return f"the refused load changed the state: {after['mismatches'][:4]}"
    return None


def _reference(world, spec, root, cells, verdicts):
    """The uninterrupted run of a family: train, save every cell, train on; its snapshot."""
    model, optimizer = build(cells[0], SAVE_SEED, spec.device)
    train(model, optimizer, cells[0], TRAIN_STREAM, STEPS_BEFORE, spec.device)
    for cell in cells if spec.save else ():
        folder = checkpoint_folder(root, spec.tag, cell)
        verdicts[f"{spec.tag}-{cell.name}-save"] = _verdict(
            save, cell, model, optimizer, folder, world
        )
    train(model, optimizer, cells[0], FOLLOW_UP_STREAM, STEPS_AFTER, spec.device)
    return reference_snapshot(model, optimizer)


def _loads(world, spec, root, cell, reference):
    """The verdicts of ``cell``'s loads: its own checkpoint, then earlier worlds'."""
    found = {}
    if spec.save:
        own = checkpoint_folder(root, spec.tag, cell)
        found["resume"] = _verdict(_resume, world, spec, cell, own, reference)
        world.barrier()
    for size in spec.load_from:
        folder = checkpoint_folder(root, spec.source_tag(size), cell)
        if size == spec.data_parallel:
            body = _resume, world, spec, cell, folder, reference
        elif cell.case.fmt in RESHARDING_FORMATS:
            body = _reshard, world, spec, cell, folder, reference
        else:
            body = _refused, world, spec, cell, folder, size
        found[spec.load_key(size)] = _verdict(*body)
        world.barrier()
    return found


def _run_family(world, spec, root, cells, verdicts):
    """One uninterrupted run for ``cells`` (one family), then each cell's loads. Where the
    uninterrupted run fails, its error is every cell's verdict."""
    try:
        reference = _reference(world, spec, root, cells, verdicts)
    except FAILURES as error:  # pylint: disable=broad-exception-caught
        problem = f"the uninterrupted run failed: {_error_text(error)}"
        for cell in cells:
            for kind in ("save", "resume") if spec.save else ():
                verdicts.setdefault(f"{spec.tag}-{cell.name}-{kind}", problem)
            for size in spec.load_from:
                verdicts[f"{spec.tag}-{cell.name}-{spec.load_key(size)}"] = problem
        return
    release_host()
    for cell in cells:
        for kind, verdict in _loads(world, spec, root, cell, reference).items():
            verdicts[f"{spec.tag}-{cell.name}-{kind}"] = verdict


def release_host():
    """Free what the last cell left (host memory; the GPU allocator's cache on GPUs)."""
    if torch.cuda.is_available():
        release()


def run(world, spec, root):
    """Every cell of ``spec`` on this rank, family by family, then the faults.

    Returns:
        dict: cell key -> None or error text.
    """
    verdicts = {}
    ordered = sorted(spec.cells, key=lambda cell: cell.family)
    for _, family in itertools.groupby(ordered, key=lambda cell: cell.family):
        _run_family(world, spec, root, list(family), verdicts)
    for fault in spec.faults:
        verdicts.update(multirank_faults.run(fault, world, spec, root))
    return verdicts
