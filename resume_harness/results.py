# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The files a job leaves behind: the save job's manifest, each load rank's part and marker of
the case under way, and the merge of the parts into one result per case."""

import json
from pathlib import Path

MANIFEST = "manifest.json"


def write_json(path, payload):
    """Write ``payload`` to ``path`` through a temporary file, so a reader never sees half."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str), encoding="utf-8")
    tmp.replace(path)


def rank_file(out, rank_index):
    """The part of result file ``out`` that rank ``rank_index`` writes."""
    return Path(f"{out}.rank{rank_index}")


def current_file(out, rank_index):
    """The marker naming the case rank ``rank_index`` is loading."""
    return Path(f"{out}.current.rank{rank_index}")


def merge_case(parts):
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
        "load_phase_seconds",
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
        path = rank_file(out, index)
        parts.append(json.loads(path.read_text(encoding="utf-8")) if path.exists() else {})
    keys = sorted(set().union(*parts))
    merged = {}
    for key in keys:
        present = [part[key] for part in parts if key in part]
        if len(present) < world:
            present[0] = dict(present[0], error=f"only {len(present)} of {world} ranks reported")
        merged[key] = merge_case(present)
    return merged
