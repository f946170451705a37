# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""Tables of DistributedOptimizer resume results: one line per case, and upstream 0.19.2 beside the
fork (each resuming its own checkpoint)."""


def _mib(value, digits=2):
    return "-" if value is None else f"{value / 2**20:.{digits}f}"


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


def _phase_peak(*names):
    """The figure of the first of ``names`` (phases of one format or another) a result has."""

    def show(result):
        phases = result.get("load_phase_peak_gpu_extra_bytes") or {}
        return _mib1(next((phases[n] for n in names if n in phases), None))

    return show


# Host side of the resume, then the GPU peak of each load phase above the start of the load:
# dist-checkpoint formats describe the optimizer for the load (is_loading: the scaffold, the
# first pass), read, then load (the second pass); legacy loads the common state dict, then
# the parameter state.
SIDE_BY_SIDE_TABLES = [
    (
        "exactness, pinned host memory (MiB, largest rank)",
        [
            ("exact", lambda r: "yes" if r.get("exact") else "NO"),
            ("pin cold", lambda r: _mib1(r.get("pinned_cold_bytes"))),
            ("pin load", lambda r: _mib1(r.get("pinned_after_load_bytes"))),
            ("pin step", lambda r: _mib1(r.get("pinned_after_steps_bytes"))),
            ("load ms", lambda r: _ms_or_dash(r.get("load_seconds"))),
        ],
    ),
    (
        "GPU memory the load adds, peak per phase (MiB, largest rank)",
        [
            ("pass 1", _phase_peak("is_loading", "state_dict")),
            ("read", _phase_peak("read")),
            ("pass 2", _phase_peak("load_state_dict", "param_state")),
            ("peak", lambda r: _mib1(r.get("load_peak_gpu_extra_bytes"))),
        ],
    ),
]


def side_by_side(results):
    """One row per case: upstream's figures beside the fork's (both resuming their own)."""
    names = sorted({key.rsplit("-", 1)[0] for key in results})
    width = max([30, *map(len, names)])
    for title, figures in SIDE_BY_SIDE_TABLES:
        heads = "".join(f"{head:>11}" for head, _ in figures)
        print(f"\n{title}")
        print(f"{'':{width}} | {'upstream 0.19.2':{len(heads)}} | fork")
        print(f"{'case':{width}} | {heads} | {heads}")
        for name in names:
            row = []
            for side in ("upstream", "fork"):
                result = results.get(f"{name}-{side}2{side}", {})
                if result.get("skipped"):
                    row.append(f"{'skipped':>11}" + " " * (len(heads) - 11))
                else:
                    row.append("".join(f"{show(result):>11}" for _, show in figures))
            print(f"{name:{width}} | {row[0]} | {row[1]}")


def _mib1(value):
    return _mib(value, 1)


def _ms_or_dash(value):
    return "-" if value is None else f"{value * 1000:.0f}"
