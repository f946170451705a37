# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""The bodies of the save and load jobs, one process per rank under torchrun.

The save job trains each case, checkpoints it, goes on and keeps the reference; the load job
builds a fresh model and optimizer, loads, resumes and compares. Each rank writes its figures
as it goes, so that a job that dies in one case can be started again after it.
"""

import dataclasses
import gc
import json
import shutil
import time
import traceback
from pathlib import Path

import torch

from megatron_optimizer_fork.memory import pinned_bytes_held, release_cached_pinned_memory

from .cases import Case, Shape, selected_cases
from .measure import LoadPlanLog, PhasePeaks, optimizer_state_bytes, warm_page_cache
from .results import MANIFEST, current_file, merge_rank_files, rank_file, write_json
from .snapshots import compare, snapshot
from .worker import (
    FOLLOW_UP_STREAM,
    LOAD_SEED,
    SAVE_SEED,
    TRAIN_STREAM,
    build,
    distributed_optimizers,
    inner_settings,
    load_checkpoint,
    needs_priming,
    prime,
    release,
    save_checkpoint,
    train,
)


def _error_text(error):
    # The whole traceback goes to the log; the result keeps the message.
    traceback.print_exc()
    return f"{type(error).__name__}: {error}".replace("\n", " ")[:2000]


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
        write_json(root / MANIFEST, manifest)
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
        write_json(folder / f"status_rank{rank.rank}.json", status)
        release()
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
    release()
    if needs_priming(case, args.load_with, optimizer, args.prime):
        prime(optimizer)
        result["primed"] = True
    result["page_cache_warmed_bytes"] = warm_page_cache(
        folder if case.fmt == "legacy" else folder / "dist"
    )
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
    result["load_phase_seconds"] = peaks.seconds
    if peaks.profile:
        result["load_phase_profiles"] = peaks.profiles
    result["load_peak_gpu_extra_bytes"] = max(peaks.peaks.values())
    result["optimizer_state_bytes"] = optimizer_state_bytes(optimizer)
    gc.collect()
    result["pinned_after_load_bytes"] = pinned_bytes_held()
    train(model, optimizer, case, FOLLOW_UP_STREAM, manifest["steps_after"], rank.rank, shape)
    result["pinned_after_steps_bytes"] = pinned_bytes_held()
    reference = torch.load(folder / f"reference_rank{rank.rank}.pt", weights_only=False)
    result.update(compare(reference, snapshot(model, optimizer)))
    return result


def run_load(args, rank, module_file):
    """Load every case of every ``--ckpt-dir``; each rank writes its part next to ``--out``.

    The part is rewritten after every case, and the case under way is named in a marker
    file, so that a job killed by one case (a CUDA error that ends the process) can be
    started again from the next one (see :func:`_load_until_done`): with ``--continue-load``
    the cases already in the part are not run again.
    """
    part = rank_file(args.out, rank.rank)
    results = {}
    if args.continue_load and part.exists():
        results = json.loads(part.read_text(encoding="utf-8"))
    for root in args.ckpt_dir:
        manifest, cases = _saved_cases(root, rank.world)
        for case in cases:
            key = case.key(rank.world, manifest["save_with"], args.load_with)
            if key in results:
                continue
            write_json(current_file(args.out, rank.rank), {"case": key})
            print(f"{time.strftime('%H:%M:%S')} [rank {rank.rank}] load {key}", flush=True)
            result = {}

            def built(so_far, key=key):
                # Marked unfinished: a restart after the process died keeps these figures.
                results[key] = dict(so_far, case=key, unfinished=True)
                write_json(part, results)

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
            write_json(part, results)
            release()
    current_file(args.out, rank.rank).unlink(missing_ok=True)
    rank.barrier()
    if rank.rank == 0:
        merged = merge_rank_files(args.out, rank.world)
        write_json(args.out, merged)


# --------------------------------------------------------------------------- merging, driving
