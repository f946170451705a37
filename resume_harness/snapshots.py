# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Snapshots of a run (parameters, this rank's optimizer state, the common state dict) and their
bit-exact comparison."""

import torch

from .worker import distributed_optimizers


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
