# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The upstream2upstream control: megatron-core 0.19.2 resuming its own checkpoint. What fails
there is megatron-core's own bug, and is not counted against the fork where the fork's checkpoint
fails the same way in upstream."""

CONTROL_PAIR = ("upstream", "upstream")


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
