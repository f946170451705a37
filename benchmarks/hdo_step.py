# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""HDO step time against its hardware floor, upstream 0.19.2 beside the fork, in one run.

The floor of an offloaded step is what the hardware must do for the offloaded parameters:
a fused host AdamW step over them, their gradients down (D2H) and their parameters up (H2D)
in the model's dtype at the pinned bandwidth. All three are measured here, on the spot, with
the same tensor sizes; the HDO steps are then timed for each offload fraction and reported
as a ratio to that floor. Both implementations run the configuration Megatron builds for
``optimizer_cpu_offload`` (bf16 parameters, fp32 master copies, torch AdamW with
``fused=True``), and their parameters after the timed steps are compared bit for bit. Gradients
come as each parameter's bf16 ``.grad``, or with ``--grads decoupled`` as the precision-aware
distributed optimizer hands them (fp32 ``decoupled_grad`` views of one buffer, the parameters
views of another), with the same values.

Cases (``--case``) are the parameter lists a DistributedOptimizer hands its HDO (see
``hdo_cases``): ``dense32`` (536M in 32 equal tensors, or ``--numel`` / ``--tensors``), ``gpt``
(757M: embedding, 24 layers of QKV, projection, two MLP matrices, biases and LayerNorms),
``llama`` (693M: untied embedding and output layer, grouped-query attention, SwiGLU, RMSNorm,
no biases), ``moe`` (657M in 3,291 tensors, 64 experts per layer) and ``stress`` (4,096 x
65,536). Besides the serial floor (the sum of the three) the overlap limit is reported: the
longest of the three, which a pipeline that overlaps them approaches, and the contended limit:
the same with host AdamW timed beside one D2H and one H2D of the same bytes, since the copies'
DMA shares the host's memory bandwidth with AdamW (``adam|copies s``); and the same again with
fp32 copies, the bytes the fork's pipeline moves (gradients widened and masters narrowed on the
device: ``adam|fp32 s``, ``/fp32 contended``), apart from the issue's bounds, which count bf16.
Torch's fused AdamW runs one parallel region per tensor, so the floor's AdamW carries a cost
per shard; ``adam flat s`` is the same AdamW over the same elements as flat 64 MiB blocks (one
tensor per fork HDO bucket), shown beside the limits as the headroom a step over whole buckets
would have, not used in them. Only ``step()`` is timed; what the benchmark itself does between
steps (handing out gradients) is timed apart and reported as ``outside s``, and the time
Python's garbage collector ran inside timed steps as ``gc s`` (a full collection runs after the
warm-up, so the state the first steps created is not collected in a timed one). Step times
differ more between processes than between the steps of one (up to a fifth on the H200 host,
for the same code), so ``--rounds`` starts several processes per implementation in turn and
reports the median over them.

Without CUDA there is nothing to offload to: the figures are then host-only and labelled so.
"""

import argparse
import functools
import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import List

import torch
from hdo_cases import CASES, case_numels
from hdo_step_breakdown import breakdown, profile

from megatron_optimizer_fork import load_upstream_module
from megatron_optimizer_fork.memory import pinned_bytes_held, pinned_bytes_in_use

FLAT_BLOCK_NUMEL = 16 << 20
"""fp32 elements of one of the fork HDO's host buckets (64 MiB), for ``adam flat s``."""


TREE_PREFIX = "fork@"
"""Rows of ``--fork-tree``: ``fork@PATH`` times the fork's modules of the checkout at PATH."""

BUCKET_PREFIX = "fork buckets MiB "
"""Rows of ``--bucket-mib``: ``fork buckets MiB N`` times the fork with host buckets (and parts)
of N MiB."""


def fork_class(tree=None):
    """The fork's HybridDeviceOptimizer as ``megatron.core`` resolves it, or from the
    ``megatron/`` folder of checkout ``tree`` (in a worker, before anything imported it)."""
    # pylint: disable=import-outside-toplevel
    import megatron_optimizer_fork as overlay

    if tree is not None:
        try:
            overlay.serve_from(tree)
        except ValueError as error:
            raise SystemExit(f"--fork-tree {error}") from None
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    assert getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False), "overlay is off"
    served = os.path.abspath(hybrid_optimizer.__file__)
    if tree is not None and not served.startswith(overlay.fork_root()):
        raise SystemExit(f"--fork-tree {tree}: the fork came from {hybrid_optimizer.__file__}")
    return hybrid_optimizer.HybridDeviceOptimizer


# Variants of the fork timed beside it in the same run, each behind an option: the option's
# dest, the class attributes the variant changes, and what the option's help says it times.
FORK_VARIANTS = {
    "fork per-copy": (
        "per_copy",
        {"flat_host_steps": False},
        "its host buckets stepped copy by copy (flat_host_steps off), as the reference its "
        "flat step is measured against",
    ),
    "fork parts": (
        "parts",
        {"host_part_bytes": 16 << 20},
        "host copies larger than 16 MiB stepped and moved in parts of 16 MiB (host_part_bytes)",
    ),
    "fork whole copies": (
        "whole_copies",
        {"host_part_bytes": 0},
        "every host copy stepped and moved whole (host_part_bytes 0), as the reference the "
        "default's parts for copies larger than a bucket (64 MiB: embeddings, output layers) "
        "are measured against",
    ),
    "fork fixed buckets": (
        "fixed_buckets",
        {"size_host_buckets": False},
        "its host buckets capped at 64 MiB whatever the offload (size_host_buckets off), as the "
        "reference the default's buckets sized to the offloaded bytes (an eighth of them, "
        "16-64 MiB; below 64 MiB only where less than 512 MiB is offloaded) are measured against",
    ),
}


def fork_variant_class(name: str):
    """The fork's HybridDeviceOptimizer with the class attributes of variant ``name``."""
    return type("HybridDeviceOptimizer", (fork_class(),), dict(FORK_VARIANTS[name][1]))


def bucket_variant_class(mib: int):
    """The fork's HybridDeviceOptimizer with host buckets of ``mib`` MiB whatever the offload
    and copies larger than that in parts of it. The cap is the module's constant, so this sets
    it for the whole process: call it only in a worker of its own."""
    cls = fork_class()
    sys.modules[cls.__module__]._HOST_BUCKET_BYTES = mib << 20
    attributes = {"host_part_bytes": mib << 20, "size_host_buckets": False}
    return type("HybridDeviceOptimizer", (cls,), attributes)


def in_place_class(choice: str):
    """The optimizer of the parameters stepped in place: ``factory`` is the one Megatron's
    optimizer factory hands the HDO (Transformer Engine's FusedAdam where it imports, else
    Apex's, else torch's AdamW), ``torch`` is torch's AdamW."""
    if choice == "torch":
        return torch.optim.AdamW
    from megatron.core import optimizer as factory  # pylint: disable=import-outside-toplevel

    return factory.Adam


def upstream_class():
    """megatron-core 0.19.2's HybridDeviceOptimizer from its own file."""
    return load_upstream_module("optimizer.cpu_offloading.hybrid_optimizer").HybridDeviceOptimizer


def sync(device):
    """Wait for the accelerator, if any."""
    if device == "cuda":
        torch.cuda.synchronize()


class CollectorPauses:
    """Seconds Python's cyclic garbage collector ran while ``timing`` is set.

    A collection runs whenever enough container objects were allocated, in whatever call is
    running then; its length grows with the whole process's heap (torch, megatron), not with
    the call it lands in, so it is reported apart rather than left unexplained in a step.
    """

    def __init__(self):
        self.timing = False
        self.seconds = 0.0
        self._started = None

    def __call__(self, phase, _info):
        if phase == "start":
            self._started = time.perf_counter()
        elif self.timing and self._started is not None:
            self.seconds += time.perf_counter() - self._started

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def timed(fn, device, repeats, warmup=1, before=None, beside=None, block=1):
    """Wall times of ``fn`` over ``repeats`` runs after ``warmup`` runs, and of ``before``.

    ``before`` (the benchmark's own work, such as handing out gradients) runs ahead of each
    call and is timed on its own, outside the time of ``fn``. ``beside`` (a reference to hold
    ``fn`` against) runs in blocks of ``block`` calls, one block before every ``block`` timed
    calls of ``fn`` and one after the last, so that each timed call has a block on either side
    (see :func:`block_references`); it also runs once, untimed, in the warm-up. A full
    collection runs after the warm-up, so that the objects the first calls made (the
    optimizer's state) are not collected inside a timed call; collections that still land in
    one are counted.

    Returns:
        ``{"median", "min", "max"}`` of ``fn``, ``"times"``, its timed calls in order,
        ``"outside"``, the median of ``before``, ``"beside"``, each timed call's reference time
        (empty without ``beside``), ``"beside_blocks"``, the times of each block, and ``"gc"``,
        the seconds the collector ran inside the timed calls of ``fn``, in all.
    """
    outside, times, blocks = [], [], []

    def reference_block():
        block_times = []
        for _ in range(block):
            start = time.perf_counter()
            beside()
            block_times.append(time.perf_counter() - start)
        blocks.append(block_times)

    with CollectorPauses() as pauses:
        for index in range(warmup + repeats):
            if before is not None:
                sync(device)
                start = time.perf_counter()
                before()
                sync(device)
                outside.append(time.perf_counter() - start)
            if beside is not None and index == warmup - 1:
                beside()
            elif beside is not None and index >= warmup and (index - warmup) % block == 0:
                reference_block()
            if index < warmup:
                fn()
                continue
            if index == warmup:
                gc.collect()
            sync(device)
            pauses.timing = True
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
            pauses.timing = False
        if beside is not None and repeats:
            reference_block()
    return {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "times": times,
        "outside": statistics.median(outside) if outside else 0.0,
        "beside": block_references(blocks, block, len(times)) if blocks else [],
        "beside_blocks": blocks,
        "gc": pauses.seconds,
    }


def block_references(blocks: List[List[float]], block: int, count: int) -> List[float]:
    """The reference time of each of ``count`` timed calls made in runs of ``block`` between
    reference ``blocks``: the mean of the medians of the blocks before and after its run.

    Both neighbours count, so that a drift of the host over the run is met from either side,
    and a call right after the reference (which may find the host as the reference left it)
    is no more the run's only call than one further from it where ``block`` is above one.
    """
    medians = [statistics.median(times) for times in blocks]
    runs = [(before + after) / 2 for before, after in zip(medians, medians[1:])]
    return [runs[index // block] for index in range(count)]


def sizes(args):
    """Element counts of the shards rank 0's HDO steps in ``args.case``."""
    return case_numels(args.case, args.dp, args.scale, numel=args.numel, tensors=args.tensors)


def offloaded_sizes(args, fraction):
    """The tensors the HDO offloads at ``fraction`` (it fills the share in order)."""
    chosen, total, budget = [], 0, fraction * sum(sizes(args))
    for numel in sizes(args):
        if total < budget:
            chosen.append(numel)
            total += numel
    return chosen


def measure_floor(args, device, fraction):
    """Host AdamW time and pinned copy times for the offloaded tensors, measured now.

    AdamW steps the same tensors the HDO offloads (its cost per tensor is part of the
    floor); the copies move their bytes, in bf16, as one pinned block each way (the bus's
    limit, whatever the number of tensors). AdamW is also timed beside those copies, and
    beside fp32 ones (``*_fp32``), the bytes the fork's pipeline moves.
    """
    chosen = offloaded_sizes(args, fraction)
    if not chosen:
        copies = ("d2h", "h2d", "adam_beside_copies", "d2h_fp32", "h2d_fp32")
        return dict.fromkeys(("adam", "adam_flat", *copies, "adam_beside_fp32_copies"), 0.0)
    generator = value_generator(device, seed=1)
    adam = host_adam(chosen, generator, device)
    result = {"adam": timed(adam.step, "cpu", args.repeats)["median"]}
    result["adam_flat"] = flat_adam_seconds(sum(chosen), generator, device, args.repeats)
    if device != "cuda":
        result.update(d2h=0.0, h2d=0.0, d2h_fp32=0.0, h2d_fp32=0.0)
        result.update(adam_beside_copies=result["adam"], adam_beside_fp32_copies=result["adam"])
        return result
    # bf16 bytes for the bounds; fp32, what the fork's pipeline moves, for its own.
    for suffix, nbytes in (("", sum(chosen) * 2), ("_fp32", sum(chosen) * 4)):
        down, up = copy_pair(nbytes), copy_pair(nbytes)
        result["d2h" + suffix] = timed(
            lambda pair=down: pair[1].copy_(pair[0], non_blocking=True), device, args.repeats
        )["median"]
        result["h2d" + suffix] = timed(
            lambda pair=up: pair[0].copy_(pair[1], non_blocking=True), device, args.repeats
        )["median"]
        beside = "adam_beside_fp32_copies" if suffix else "adam_beside_copies"
        result[beside] = adam_beside_copies(adam, down, up, args.repeats)
        del down, up
    nbytes = sum(chosen) * 2
    result["d2h_gbps"] = nbytes / result["d2h"] / 1e9
    result["h2d_gbps"] = nbytes / result["h2d"] / 1e9
    del adam
    gc.collect()
    return result


def adam_times(floor):
    """Host AdamW alone before and after the rows (0.0 where not timed)."""
    return floor.get("adam_before", 0.0), floor.get("adam_after", 0.0)


def host_adam(numels, generator, device):
    """Fused host AdamW over fp32 host tensors of ``numels`` elements, with gradients."""
    params = [random_values(n, generator, device).cpu() for n in numels]
    for p in params:
        p.grad = random_values(p.numel(), generator, device).mul_(1e-3).cpu()
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)


def adam_again(args, device, fraction, floor):
    """The floor with host AdamW alone timed again, after a fraction's rows.

    The host's memory bandwidth, which AdamW is bound by, drifts over the minutes the rows
    take (a third between runs on one machine), so the floor's AdamW is the mean of its
    time before the rows and after them (``adam_before``, ``adam_after``); the copies and
    AdamW beside them keep their one measurement.
    """
    chosen = offloaded_sizes(args, fraction)
    if not chosen:
        return {**floor, "adam_before": 0.0, "adam_after": 0.0}
    adam = host_adam(chosen, value_generator(device, seed=1), device)
    after = timed(adam.step, "cpu", args.repeats)["median"]
    del adam
    gc.collect()
    before = floor["adam"]
    return {**floor, "adam": (before + after) / 2, "adam_before": before, "adam_after": after}


def flat_blocks(numel, block_numel=FLAT_BLOCK_NUMEL):
    """Sizes of ``numel`` elements cut into blocks of ``block_numel`` (the last shorter)."""
    return [min(block_numel, numel - start) for start in range(0, numel, block_numel)]


def flat_adam_seconds(numel, generator, device, repeats):
    """Median time of fused host AdamW over ``numel`` elements as flat 64 MiB blocks.

    The same bytes as the floor's AdamW, but one tensor (and one parallel region) per HDO
    bucket instead of one per shard: how fast the host step could be without its per-tensor
    cost, which the floor's own AdamW includes.
    """
    params = [random_values(n, generator, device).cpu() for n in flat_blocks(numel)]
    for p in params:
        p.grad = random_values(p.numel(), generator, device).mul_(1e-3).cpu()
    adam = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    seconds = timed(adam.step, "cpu", repeats)["median"]
    del adam, params
    gc.collect()
    return seconds


def value_generator(device, seed=0):
    """A seeded generator on ``device``: values drawn there are the same in every process."""
    return torch.Generator(device=device).manual_seed(seed)


def random_values(numel, generator, device):
    """``numel`` standard-normal fp32 values drawn on ``device``.

    Drawn on the accelerator where there is one: the host draws about 0.1G values a second,
    which for the larger cases took longer than the steps being timed.
    """
    return torch.randn(numel, generator=generator, device=device)


def pinned_block(nbytes):
    """A pinned host buffer of ``nbytes``."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def copy_pair(nbytes):
    """``(device buffer, pinned host buffer)`` of ``nbytes`` each: one copy direction's ends."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda"), pinned_block(nbytes)


def adam_beside_copies(adam, down, up, repeats):
    """Host AdamW's median time with one D2H and one H2D of the offloaded bytes queued on
    their own streams as it starts.

    The copies' DMA reads and writes host memory while AdamW streams through it, so AdamW
    may be slower beside them than alone. A step that overlaps all three moves the same bytes
    once each way during its AdamW, so it can come no closer than the longest of this and the
    two copies (the contended limit).
    """
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        with torch.cuda.stream(streams[0]):
            down[1].copy_(down[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            up[0].copy_(up[1], non_blocking=True)
        start = time.perf_counter()
        adam.step()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(times)


GRADIENT_ATTRIBUTES = {"model": "grad", "decoupled": "decoupled_grad"}
"""Where each ``--grads`` layout leaves a parameter's gradient for the HDO."""


def parameters_and_gradients(args, device):
    """The parameters the HDO steps and the gradients handed out before each step.

    ``--grads model``: each bf16 parameter and its bf16 gradient a tensor of its own.
    ``--grads decoupled``: as Megatron's precision-aware distributed optimizer hands them
    (``--use-precision-aware-optimizer``, the flag offloading recipes pair with
    ``--optimizer-cpu-offload``, with ``--accumulate-allreduce-grads-in-fp32``): the bf16
    parameter shards are views into one parameter buffer and their fp32 gradients, set as
    ``decoupled_grad``, views into one gradient buffer, both laid out back to front. The values
    are the same in both layouts (the gradients are drawn in bf16 and widened), so the
    parameters after the steps are too.
    """
    return shard_tensors(sizes(args), args.grads, device)


def shard_tensors(numels, layout, device):
    """Parameters of ``numels`` elements and their gradients in gradient ``layout`` (a
    ``--grads`` choice), as :func:`parameters_and_gradients` describes them."""
    generator = value_generator(device)
    values, grads = [], []
    for numel in numels:
        values.append(random_values(numel, generator, device).to(torch.bfloat16))
        grads.append(random_values(numel, generator, device).mul_(1e-2).to(torch.bfloat16))
    if layout == "model":
        return [torch.nn.Parameter(value) for value in values], grads
    # The buffers hold the parameters back to front, as megatron-core's DDP lays them out.
    numels = [value.numel() for value in reversed(values)]
    param_buffer = torch.cat(values[::-1])
    grad_buffer = torch.cat(grads[::-1]).to(torch.float32)
    del values, grads
    params = [torch.nn.Parameter(view) for view in param_buffer.split(numels)][::-1]
    return params, list(grad_buffer.split(numels))[::-1]


def defining_file(hdo_class):
    """The file of the HybridDeviceOptimizer module a row times (variants subclass it)."""
    for cls in hdo_class.__mro__:
        if cls.__module__.endswith("hybrid_optimizer"):
            return getattr(sys.modules.get(cls.__module__), "__file__", None)
    return None


def build_hdo(hdo_class, params, fraction, overlap, in_place):
    """An HDO of ``hdo_class`` over ``params`` as Megatron's factory builds it for
    ``optimizer_cpu_offload``: fp32 master copies, torch's fused AdamW on the host, the
    ``in_place`` choice of ``--in-place`` for the rest."""
    return hdo_class(
        [{"params": params}],
        offload_fraction=fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=in_place_class(in_place),
        param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        lr=1e-4,
        weight_decay=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )


def params_digest(params) -> str:
    """sha256 of the 16-bit parameters' bits, to tell identical results apart from others."""
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.detach().cpu().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def time_hdo(hdo_class, args, device, fraction, overlap):
    """Median step time of one HDO, the pinned memory it needs, a digest of its parameters.

    Run in a process of its own (see ``run_worker``), so that the pinned memory the process
    holds is this optimizer's alone.
    """
    params, grads = parameters_and_gradients(args, device)
    optimizer = build_hdo(hdo_class, params, fraction, overlap, args.in_place)
    attribute = GRADIENT_ATTRIBUTES[args.grads]

    def hand_out_grads():
        for p, g in zip(params, grads):
            setattr(p, attribute, g)

    chosen = offloaded_sizes(args, fraction) if args.paired else []
    adam = host_adam(chosen, value_generator(device, seed=1), device) if chosen else None
    times = timed(
        optimizer.step,
        device,
        args.repeats,
        args.warmup,
        before=hand_out_grads,
        beside=None if adam is None else adam.step,
        block=max(args.paired, 1),
    )
    del adam
    result = {
        "step": times["median"],
        "step_min": times["min"],
        "step_max": times["max"],
        "outside": times["outside"],
        "gc": times["gc"],
        "pinned_held": pinned_bytes_held(),
        "pinned_live": pinned_bytes_in_use(),
        "digest": params_digest(params),
        "module": defining_file(hdo_class),
        "host_optimizers": len(optimizer.cpu_optimizers),
        "paired": [list(pair) for pair in zip(times["times"], times["beside"])],
        "paired_blocks": times["beside_blocks"],
    }
    if args.breakdown:  # after the digest: these steps change the parameters
        result["breakdown_ms"] = breakdown(optimizer, hand_out_grads)
    if args.profile:
        result["profile"] = profile(optimizer, hand_out_grads)
    del optimizer, params, grads
    gc.collect()
    return result


IMPLEMENTATIONS = {
    "upstream 0.19.2": upstream_class,
    "fork": fork_class,
    **{name: functools.partial(fork_variant_class, name) for name in FORK_VARIANTS},
}


def implementation_class(name):
    """The HybridDeviceOptimizer class of row ``name`` (see ``IMPLEMENTATIONS`` and
    ``TREE_PREFIX``)."""
    if name.startswith(TREE_PREFIX):
        return fork_class(name[len(TREE_PREFIX) :])
    if name.startswith(BUCKET_PREFIX):
        return bucket_variant_class(int(name[len(BUCKET_PREFIX) :]))
    return IMPLEMENTATIONS[name]()


def run_worker(args, name, fraction, overlap):
    """Time one implementation in a fresh interpreter; its figures as a dict."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        json.dumps([name, fraction, overlap]),
        "--case",
        args.case,
        "--dp",
        str(args.dp),
        "--scale",
        str(args.scale),
        "--numel",
        str(args.numel),
        "--tensors",
        str(args.tensors),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--in-place",
        args.in_place,
        "--grads",
        args.grads,
        *(["--breakdown"] if args.breakdown else []),
        *(["--profile"] if args.profile else []),
        *(["--paired", str(args.paired)] if args.paired else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} at {fraction} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def positive_int(text: str) -> int:
    """An argument that must be a whole number of at least one."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def parse_args(argv=None):
    """The command line; every option says what it does and shows its default."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Outputs: a table on stdout (one row per case, fraction, overlap and "
        "implementation, printed as it is measured) and OUT/hdo_step_<device>.json, rewritten "
        "after every row. Exit code 0, or 1 if a worker failed.",
    )
    parser.add_argument(
        "--case",
        nargs="+",
        choices=sorted(CASES),
        default=["dense32"],
        help="parameter lists to run (see hdo_cases.py)",
    )
    parser.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel size the shards are cut for (rank 0's are stepped)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every shard's size (smoke runs)"
    )
    parser.add_argument("--numel", type=float, default=536e6, help="dense32: total elements")
    parser.add_argument("--tensors", type=int, default=32, help="dense32: number of tensors")
    parser.add_argument(
        "--fractions", type=float, nargs="+", default=[0.5, 1.0], help="offload fractions"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=7, help="timed steps per process (at least one)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="processes per implementation, started in turn (upstream, fork, ..., then again, "
        "each round in a rotated order): a row's step is the median over its processes, as "
        "step times differ more between processes than between one process's steps",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument(
        "--overlap",
        choices=["on", "off", "both"],
        default="both",
        help="overlap_cpu_optimizer_d2h_h2d: on is the HDO's default and what Megatron's "
        "offload guide enables (--overlap-cpu-optimizer-d2h-h2d); off is OptimizerConfig's "
        "default",
    )
    parser.add_argument("--skip-upstream", action="store_true", help="time the fork alone")
    parser.add_argument(
        "--in-place",
        choices=["factory", "torch"],
        default="factory",
        help="optimizer of the parameters stepped in place: factory is what Megatron's factory "
        "hands the HDO (TE FusedAdam where Transformer Engine imports, else torch's AdamW), "
        "torch is torch's AdamW",
    )
    parser.add_argument(
        "--grads",
        choices=sorted(GRADIENT_ATTRIBUTES),
        default="model",
        help="how gradients reach the HDO: model is a bf16 .grad per parameter; decoupled is "
        "what the precision-aware distributed optimizer hands it (bf16 parameter shards viewing "
        "one buffer, fp32 decoupled_grad viewing another)",
    )
    for name, (dest, _, times) in FORK_VARIANTS.items():
        parser.add_argument(
            "--" + dest.replace("_", "-"),
            action="store_true",
            help=f"also time the fork with {times}, in the same run (row: {name})",
        )
    parser.add_argument(
        "--paired",
        nargs="?",
        type=positive_int,
        const=1,
        default=0,
        metavar="K",
        help="also time host AdamW alone over the offloaded tensors in each row's own process, "
        "in blocks of K (default 1) between runs of K timed steps and after the last, and hold "
        "each step against the limit taken with the mean of the two blocks' medians around it "
        "(max(that AdamW, D2H, H2D)): /paired is the median of those ratios, paired adam s the "
        "median of those AdamW times. The host's bandwidth drifts over the minutes a case's "
        "rows take, which the limit's one timing before and after them cannot follow; a K above "
        "1 also keeps the steps right after AdamW from being all of the steps. The process then "
        "holds a second set of the offloaded tensors' host values",
    )
    parser.add_argument(
        "--bucket-mib",
        nargs="+",
        type=int,
        default=[],
        metavar="N",
        help="also time the fork with host buckets of N MiB (a power of two) instead of 64, "
        "copies larger than that moved in parts of it, in the same run (rows: "
        f"{BUCKET_PREFIX}N): whether smaller granules keep the copies' traffic in the host's "
        "last-level cache beside AdamW",
    )
    parser.add_argument(
        "--fork-tree",
        nargs="+",
        default=[],
        metavar="PATH",
        help="also time the fork's modules from the megatron/ folder of each checkout PATH "
        "(another commit: scripts/fork_tree.sh COMMIT writes it to .ab/COMMIT), in the same run "
        "and against the same floor, as rows fork@PATH; the installed megatron-core and "
        "overlay serve everything else",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="after the timed steps, time the parts of the fork's step (host steps, copies' "
        "queueing, the in-place step, the waits for downloads and the last uploads) over three "
        "more and print them under its row",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, run two more under torch.profiler and cProfile and print "
        "what they spent their time on (operators, CUDA calls and copies, Python functions) "
        "under each row",
    )
    parser.add_argument("--out", default="results", help="folder of the JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


COLUMNS = [
    ("case", 7, lambda r: r["case"]),
    ("fraction", 8, lambda r: f"{r['fraction']}"),
    ("overlap", 7, lambda r: str(r["overlap"])),
    ("implementation", 16, lambda r: r["implementation"]),
    ("step s", 7, lambda r: f"{r['step_s']:.3f}"),
    ("min-max s", 11, lambda r: f"{r['step_min_s']:.3f}-{r['step_max_s']:.3f}"),
    ("per process s", 13, lambda r: "/".join(f"{s:.3f}" for s in r["step_per_process_s"])),
    ("floor s", 7, lambda r: f"{r['floor_s']:.3f}"),
    ("limit s", 7, lambda r: f"{r['limit_s']:.3f}"),
    ("/floor", 6, lambda r: f"{r['ratio']:.2f}"),
    ("/limit", 6, lambda r: f"{r['ratio_limit']:.2f}"),
    ("/contended", 10, lambda r: f"{r['ratio_contended']:.2f}"),
    ("/fp32 contended", 15, lambda r: f"{r['ratio_fp32_contended']:.2f}"),
    ("/paired", 7, lambda r: "-" if r["ratio_paired"] is None else f"{r['ratio_paired']:.2f}"),
    ("pinned MiB", 10, lambda r: f"{r['pinned_held_mib']:.1f}"),
    ("live MiB", 8, lambda r: f"{r['pinned_live_mib']:.1f}"),
    ("adam s", 6, lambda r: f"{r['floor']['adam']:.3f}"),
    ("before/after s", 14, lambda r: "/".join(f"{t:.3f}" for t in adam_times(r["floor"]))),
    (
        "paired adam s",
        13,
        lambda r: "-" if r["paired_adam_s"] is None else f"{r['paired_adam_s']:.3f}",
    ),
    ("adam flat s", 11, lambda r: f"{r['floor'].get('adam_flat', float('nan')):.3f}"),
    ("d2h s", 6, lambda r: f"{r['floor']['d2h']:.3f}"),
    ("h2d s", 6, lambda r: f"{r['floor']['h2d']:.3f}"),
    ("adam|copies s", 13, lambda r: f"{r['floor']['adam_beside_copies']:.3f}"),
    ("adam|fp32 s", 11, lambda r: f"{r['floor'].get('adam_beside_fp32_copies', 0.0):.3f}"),
    ("outside s", 9, lambda r: f"{r['outside_s']:.3f}"),
    ("gc s", 5, lambda r: f"{r['gc_in_steps_s']:.3f}"),
    ("run s", 5, lambda r: f"{r['worker_s']:.0f}"),
    ("equal", 5, lambda r: str(r["params_equal_across_implementations"])),
]


def combined(rounds):
    """One implementation's figures over its processes: the median of their median steps,
    the extremes of all their steps, the most pinned memory any held, the median breakdown."""
    steps = [result["step"] for result in rounds]
    result = {
        **rounds[0],
        "step": statistics.median(steps),
        "step_min": min(result["step_min"] for result in rounds),
        "step_max": max(result["step_max"] for result in rounds),
        "step_per_process": steps,
        "outside": statistics.median(result["outside"] for result in rounds),
        "gc": sum(result.get("gc", 0.0) for result in rounds),
        "worker_s": sum(result["worker_s"] for result in rounds),
        "paired": [pair for result in rounds for pair in result.get("paired", [])],
        "paired_blocks": [block for result in rounds for block in result.get("paired_blocks", [])],
    }
    for key in ("pinned_held", "pinned_live"):
        result[key] = max(result[key] for result in rounds)
    if rounds[0].get("breakdown_ms"):
        result["breakdown_ms"] = {
            part: statistics.median(r["breakdown_ms"].get(part, 0.0) for r in rounds)
            for part in rounds[0]["breakdown_ms"]
        }
    return result


def row_of(case, fraction, overlap, name, result, floor, exact):
    """One table row: the step against both bounds, pinned memory, the benchmark's own time."""
    serial = floor["adam"] + floor["d2h"] + floor["h2d"]
    limit = max(floor["adam"], floor["d2h"], floor["h2d"])
    contended = max(floor["adam_beside_copies"], floor["d2h"], floor["h2d"])
    moved = max(
        floor.get("adam_beside_fp32_copies", 0.0),
        floor.get("d2h_fp32", 0.0),
        floor.get("h2d_fp32", 0.0),
    )
    # Each timed step against host AdamW timed alone around its run, in the same process.
    paired = [
        step / max(adam, floor["d2h"], floor["h2d"]) for step, adam in result.get("paired", [])
    ]
    return {
        "case": case,
        "fraction": fraction,
        "overlap": overlap,
        "implementation": name,
        "step_s": result["step"],
        "step_min_s": result["step_min"],
        "step_max_s": result["step_max"],
        "step_per_process_s": result.get("step_per_process", [result["step"]]),
        "outside_s": result["outside"],
        "gc_in_steps_s": result.get("gc", 0.0),
        "worker_s": result.get("worker_s", 0.0),
        "breakdown_ms": result.get("breakdown_ms", {}),
        "floor_s": serial,
        "limit_s": limit,
        "ratio": result["step"] / serial if serial else float("nan"),
        "ratio_limit": result["step"] / limit if limit else float("nan"),
        "limit_contended_s": contended,
        "ratio_contended": result["step"] / contended if contended else float("nan"),
        "limit_fp32_contended_s": moved,
        "ratio_fp32_contended": result["step"] / moved if moved else float("nan"),
        "paired_adam_s": statistics.median(a for _, a in result["paired"]) if paired else None,
        "ratio_paired": statistics.median(paired) if paired else None,
        "pinned_held_mib": result["pinned_held"] / 2**20,
        "pinned_live_mib": result["pinned_live"] / 2**20,
        "floor": floor,
        "params_equal_across_implementations": exact,
        "digest": result.get("digest"),
    }


def host_processor() -> str:
    """The host processor's model name (Linux), since host AdamW's speed is the host's."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            names = [
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            ]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "unknown"


def main():
    """Measure the floor and both implementations per case and fraction; print, save."""
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        args.case = args.case[0]
        name, fraction, overlap = json.loads(args.worker)
        print(json.dumps(time_hdo(implementation_class(name), args, device, fraction, overlap)))
        return
    label = torch.cuda.get_device_name() if device == "cuda" else "CPU only (host figures)"
    label += f", host {host_processor()}"
    print(
        f"HDO step benchmark on {label}; torch {torch.__version__}; host threads "
        f"{torch.get_num_threads()} (of {os.cpu_count()} cores); dp {args.dp}; in place "
        f"{in_place_class(args.in_place).__module__}.{in_place_class(args.in_place).__name__}; "
        f"gradients {args.grads} ({GRADIENT_ATTRIBUTES[args.grads]})"
    )
    implementations = ["fork"] + [n for n, (dest, *_) in FORK_VARIANTS.items() if vars(args)[dest]]
    implementations += [BUCKET_PREFIX + str(mib) for mib in args.bucket_mib]
    implementations += [TREE_PREFIX + tree for tree in args.fork_tree]
    if device == "cuda" and not args.skip_upstream:
        implementations.insert(0, "upstream 0.19.2")
    overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hdo_step_{device}.json")
    rows, cases = [], list(args.case)
    for case in cases:
        args.case = case
        numels = sizes(args)
        print(
            f"\n{case}: {sum(numels) / 1e6:.0f}M bf16 params in {len(numels)} tensors "
            f"({min(numels)}-{max(numels)} elements)"
        )
        print(" ".join(f"{name:>{width}}" for name, width, _ in COLUMNS), flush=True)
        for fraction in args.fractions:
            started = time.perf_counter()
            floor = measure_floor(args, device, fraction)
            floor["measured_in_s"] = time.perf_counter() - started
            by_overlap = {}
            for overlap in overlaps:
                processes = by_overlap[overlap] = {name: [] for name in implementations}
                for round_ in range(args.rounds):
                    turn = round_ % len(implementations)
                    for name in implementations[turn:] + implementations[:turn]:
                        started = time.perf_counter()
                        result = run_worker(args, name, fraction, overlap)
                        result["worker_s"] = time.perf_counter() - started
                        processes[name].append(result)
            floor = adam_again(args, device, fraction, floor)
            for overlap, processes in by_overlap.items():
                digests = {result["digest"] for rounds in processes.values() for result in rounds}
                exact = len(digests) == 1
                results = {name: combined(rounds) for name, rounds in processes.items()}
                for name, result in results.items():
                    rows.append(row_of(case, fraction, overlap, name, result, floor, exact))
                    # Each row as soon as it is known, so a run cut short keeps what it has.
                    print(" ".join(f"{cell(rows[-1]):>{width}}" for _, width, cell in COLUMNS))
                    parts = result.get("breakdown_ms")
                    if parts:
                        print(
                            "    ms a step: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
                        )
                    for title, text in result.get("profile", {}).items():
                        print(f"    profile ({title}), {name} {case} {fraction}:\n{text}")
                sys.stdout.flush()
                with open(path, "w", encoding="utf-8") as out:
                    summary = {**vars(args), "case": cases}
                    json.dump({"device": label, "args": summary, "rows": rows}, out, indent=1)
    legend = (
        "floor = fused host AdamW over the offloaded tensors + bf16 D2H + bf16 H2D of their "
        "bytes (one pinned block each way); adam = that AdamW alone, the mean of its times "
        "before and after the fraction's rows (before/after); limit = the longest of the "
        "three; adam flat = that "
        "AdamW over the same elements as flat 64 MiB blocks (one tensor per HDO bucket; not in "
        "the limits); contended = the "
        "same with AdamW timed beside one D2H and one H2D of those bytes (adam|copies); fp32 "
        "contended = the same with the fp32 copies the fork moves (adam|fp32, and those copies' "
        "own times), not one of the issue's bounds; /paired (--paired K) = the median over the "
        "timed steps of each step against the limit with AdamW alone timed in the row's own "
        "process, in blocks of K before and after each run of K steps (the mean of the two "
        "blocks' medians; paired adam, their median); step = "
        "median of step() alone (the median over --rounds processes; min-max over all their "
        "steps); per process = each process's median step; outside = the benchmark's own work "
        "per step (handing out gradients), not in step; gc = seconds Python's garbage collector "
        "ran inside the timed steps, all processes together (a full collection runs after the "
        "warm-up); run = the row's processes, start to end "
        "(the floor's own time is floor.measured_in_s in the JSON); pinned = pinned host memory "
        "the process holds after the timed steps (one process per row, allocator cache "
        "included); live = pinned storage its tensors use; equal = identical parameters "
        "(sha256) across implementations; fork@PATH = the fork's modules from checkout PATH "
        "(--fork-tree)"
    )
    print(f"\n{legend}; {path}")


if __name__ == "__main__":
    main()
