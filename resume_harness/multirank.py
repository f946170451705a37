# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The multi-rank resume matrix: spawn a world of ranks, run many cells in it, collect one
verdict per cell.

A :class:`WorldSpec` names a world (its size, tensor-parallel size, implementation, device) and
the cells it runs. :func:`run_world` spawns it (``torch.multiprocessing``, one process per rank,
gloo on CPU or NCCL on GPUs, see :mod:`resume_harness.cpu_world`) and returns
``{cell key: None or the first rank's error}``. Worlds share a checkpoint folder: a world saves
every cell at its data-parallel size, and a later world of another size loads what earlier
worlds saved (``from-dp<M>`` cells), so that resharding is tested between real worlds. A world
may import the fork's modules of another checkout (``fork_tree``) and load what worlds of this
checkout saved, or the other way round (``saved_by``), so that checkpoints are tested between
two versions of the fork.

Cell keys: ``<impl>-dp<N>[-tp<T>]-<cell>-resume`` and ``...-save`` (save, resume at the
same size), ``...-from-dp<M>`` (saved at M, loaded at N), ``...-from-<impl>-dp<M>`` (saved by
the worlds of ``<impl>``), ``...-fault-<fault>`` (see :mod:`resume_harness.multirank_faults`).
``<impl>`` is ``fork``, ``upstream`` or ``fork@<folder>`` (the fork of checkout ``<folder>``).
"""

import dataclasses
import json
import os
import socket
import traceback
from pathlib import Path
from typing import Tuple

import torch

from . import multirank_cells
from .cpu_world import World, quiet
from .worker import FORK_TREE_ENV, select_implementation

FORK_ENV = "MEGATRON_OPTIMIZER_FORK"


@dataclasses.dataclass(frozen=True)
class WorldSpec:
    """One spawned world and what it runs.

    Attributes:
        size: number of ranks (processes).
        cells: the :class:`~resume_harness.multirank_rank.Cell` configurations.
        implementation: ``fork`` or ``upstream`` (megatron-core 0.19.2's own modules).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank).
        tensor_parallel: tensor-parallel size (data-parallel size is ``size // tensor_parallel``).
        save: save every cell and resume it at this size (else only load others' saves).
        load_from: data-parallel sizes whose checkpoints (saved by earlier worlds) it loads.
        faults: names of :data:`~resume_harness.multirank_faults.FAULTS` to inject.
        timeout_s: collective timeout of the ranks.
        fork_tree: a checkout whose ``megatron/`` folder serves the fork's modules in this world
            (another version of the fork); empty: the installed overlay's.
        saved_by: the :attr:`implementation_tag` of the worlds whose checkpoints ``load_from``
            reads; empty: this world's own.
    """

    size: int
    cells: Tuple = ()
    implementation: str = "fork"
    device: str = "cpu"
    tensor_parallel: int = 1
    save: bool = True
    load_from: Tuple[int, ...] = ()
    faults: Tuple[str, ...] = ()
    timeout_s: int = 180
    fork_tree: str = ""
    saved_by: str = ""

    @property
    def implementation_tag(self):
        """``fork``, ``upstream``, or ``fork@<folder name>`` where ``fork_tree`` is given."""
        if self.fork_tree:
            return f"fork@{Path(self.fork_tree).name}"
        return self.implementation

    def source_tag(self, size):
        """The tag of the world whose checkpoints of data-parallel size ``size`` it loads."""
        return f"{self.saved_by or self.implementation_tag}-dp{size}"

    def load_key(self, size):
        """The key fragment of a load of size ``size``: ``from-dp<size>``, naming the saving
        implementation where it is another one (``from-fork@<folder>-dp<size>``)."""
        return f"from-{self.saved_by}-dp{size}" if self.saved_by else f"from-dp{size}"

    @property
    def data_parallel(self):
        """Data-parallel size of the world."""
        return self.size // self.tensor_parallel

    @property
    def tag(self):
        """e.g. ``fork-dp4`` or ``upstream-dp2-tp2``: the prefix of the world's cell keys."""
        tail = f"-tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        tail += "" if self.save else "-loads"
        return f"{self.implementation_tag}-dp{self.data_parallel}{tail}"


def free_port():
    """A free TCP port on localhost, for a world's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _result_file(root, spec, rank):
    return Path(root) / "results" / f"{spec.tag}-rank{rank}.json"


def _rank_main(rank, spec, root, port):
    """The body of one spawned rank: every cell of ``spec``; its verdicts go to a file."""
    quiet()
    if spec.implementation == "upstream":
        os.environ[FORK_ENV] = "0"
    if spec.fork_tree:
        os.environ[FORK_TREE_ENV] = spec.fork_tree
    verdicts = {}
    try:
        select_implementation(spec.implementation)
        world = World(rank, spec.size, port, spec.device, spec.tensor_parallel, spec.timeout_s)
        verdicts = multirank_cells.run(world, spec, Path(root))
        world.close()
    except BaseException as error:  # pylint: disable=broad-exception-caught
        # Whatever ends the rank is one more verdict: the cells it did not reach are missing.
        verdicts["world"] = f"{type(error).__name__}: {error} {traceback.format_exc()[-1500:]}"
    path = _result_file(root, spec, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(verdicts), encoding="utf-8")


def run_world(spec, root):
    """Spawn ``spec``'s world, run its cells, merge the ranks' verdicts.

    Args:
        spec: the :class:`WorldSpec`.
        root: folder shared by the worlds of one matrix (checkpoints, results).

    Returns:
        dict: cell key -> None (passed on every rank) or ``"rank <r>: <error>"`` of the first
        rank that failed; key ``world`` when a rank ended before its cells did.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    context = torch.multiprocessing.start_processes(
        _rank_main, args=(spec, str(root), port), nprocs=spec.size, join=False, start_method="spawn"
    )
    while not context.join(timeout=spec.timeout_s * 4):
        pass
    merged = {}
    for rank in range(spec.size):
        path = _result_file(root, spec, rank)
        if not path.exists():
            merged.setdefault("world", f"rank {rank}: wrote no verdicts")
            continue
        for key, error in json.loads(path.read_text(encoding="utf-8")).items():
            if key not in merged or (merged[key] is None and error is not None):
                merged[key] = None if error is None else f"rank {rank}: {error}"
    return merged
