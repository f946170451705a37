# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Checks that a checkpoint's optimizer state fits, run before a load changes anything, and
the guard that keeps an optimizer whose load failed half-way from being used.

Loads in this fork run in two halves: a plan that reads and checks everything (these checks)
and changes nothing, then the writes. A failure in the plan leaves the optimizer as it was.
A failure during the writes (a copy, a collective, memory) cannot be undone without a second
copy of the whole state, the very copy the fork's loads avoid; the optimizer is then marked
(:class:`LoadGuard`) and refuses to step or save until a later load completes.

Non-finite values in loaded moments or master weights are reported with the parameter and
the count. What happens then is set by the environment variable
``MEGATRON_OPTIMIZER_NONFINITE_STATE``: ``error`` (the default: every later step of such a
parameter would be NaN), ``warn`` or ``ignore``.
"""

import contextlib
import logging
import math
import os
import threading
from numbers import Number
from typing import Any, Iterable, List, Optional, Sequence, Set, Tuple

import torch

logger = logging.getLogger(__name__)

NONFINITE_POLICY_ENV = "MEGATRON_OPTIMIZER_NONFINITE_STATE"
NONFINITE_POLICIES = ("error", "warn", "ignore")

# Elements per isfinite pass: bounds the temporary mask to 16 MiB whatever the tensor's size.
_NONFINITE_CHUNK = 1 << 24

# The accelerator devices and dtypes whose scan kernel has been (or is being) launched in this
# process, guarded by the lock, and the warm-up threads not yet waited for.
_scan_kernels_loaded: Set[Tuple[torch.device, torch.dtype]] = set()
_scan_kernels_lock = threading.Lock()
_scan_warm_up: List[threading.Thread] = []
# Enough elements for a reduction over many blocks, as the scanned tensors get (256 KiB of fp32).
_WARM_UP_ELEMENTS = 1 << 16


def step_value(value: Any, where: str) -> Any:
    """Check a loaded Adam step counter; return it as it may be loaded.

    A tensor of one element or a real number is accepted, as torch's optimizers accept them,
    when it is a whole, finite, non-negative count.

    Raises:
        ValueError: for None, a bool, another type, a tensor of several elements, or a value
            that is negative, not finite or not whole. The message names ``where``.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where}: the step counter is a tensor of shape {tuple(value.shape)}")
        number = float(value.detach().reshape(()).cpu())
    elif isinstance(value, Number) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValueError(f"{where}: the step counter is {value!r}, not a number")
    if not math.isfinite(number) or number < 0 or number != int(number):
        raise ValueError(f"{where}: the step counter {number} is not a whole count of steps")
    return value


def check_state_shape(value: torch.Tensor, shape: Sequence[int], key: str, where: str) -> None:
    """A state tensor must have its parameter's shape, or be that shape flattened.

    Raises:
        ValueError: naming the key, ``where`` and both shapes.
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    if tuple(value.shape) == shape or (tuple(value.shape) == (numel,) and value.dim() == 1):
        return
    raise ValueError(
        f"{where}: state '{key}' has shape {tuple(value.shape)}, the parameter has shape "
        f"{shape} (only that shape or its flat {numel} elements load)"
    )


def count_nonfinite(tensor: torch.Tensor) -> int:
    """How many elements of a floating-point ``tensor`` are NaN or infinite, counted in chunks
    so that no temporary the size of the tensor is made."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0
    flat = tensor.detach().reshape(-1)
    bad = 0
    for start in range(0, flat.numel(), _NONFINITE_CHUNK):
        chunk = flat[start : start + _NONFINITE_CHUNK]
        if chunk.element_size() == 1:  # float8 has no isfinite; fp32 holds its values
            chunk = chunk.float()
        bad += chunk.numel() - int(host_value(torch.isfinite(chunk).sum()))
    return bad


def warm_up_nonfinite_scan(tensors: Sequence[Any]) -> None:
    """Launch the scan's kernel once for each accelerator device and floating dtype among
    ``tensors``, on a background thread.

    The first launch of a kernel in a process loads it, which costs milliseconds of host time
    (CUDA loads kernels lazily). Started when a load asks for the tensors to read into, the
    thread pays that while the checkpoint is read, instead of the load's second pass. It reduces
    a small tensor of its own (``_WARM_UP_ELEMENTS``); the kinds of ``tensors`` (non-tensors
    are skipped) are found on the thread, so that a long list costs the caller nothing.
    """
    try:
        if nonfinite_policy() == "ignore" or not torch.cuda.is_available():
            return
    except ValueError:  # a bad policy is the scan's to report, in load_state_dict
        return

    def launch():
        kinds = {
            (value.device, value.dtype)
            for value in tensors
            if isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.device.type == "cuda"
        }
        kinds |= {(device, torch.float32) for device, _ in kinds}  # unscaled state is fp32
        with _scan_kernels_lock:  # another optimizer's warm-up may be running (chained ones)
            kinds -= _scan_kernels_loaded
            _scan_kernels_loaded.update(kinds)
        for device, dtype in kinds:
            try:
                with torch.cuda.device(device):
                    sample = torch.zeros(_WARM_UP_ELEMENTS, dtype=dtype, device=device)
                    _extremes_into(sample, torch.empty((2,), dtype=dtype, device=device))
            except (NotImplementedError, RuntimeError):  # no aminmax for it: the scan knows
                pass

    thread = threading.Thread(target=launch, name="nonfinite-scan-warm-up", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no thread to be had (limits, shutdown): the scan pays instead
        return
    _scan_warm_up.append(thread)


def _extremes_into(tensor: torch.Tensor, row: torch.Tensor) -> None:
    """Write the minimum and maximum of ``tensor`` into the two elements of ``row``."""
    torch.aminmax(tensor.detach().reshape(-1), out=(row[0], row[1]))


def finish_scan_warm_up() -> None:
    """Wait for the warm-up threads still running: the scan must not race them, and a load
    leaves none behind it (whether it scanned or not)."""
    while _scan_warm_up:
        _scan_warm_up.pop().join()


def nonfinite_suspects(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Indices of the floating-point ``tensors`` that may hold NaN or infinite values.

    A tensor is clear when its extremes are finite (``aminmax`` propagates NaN), which needs
    no temporary the size of the tensor. The extremes of all tensors of one device and dtype
    are written into one small tensor, copied to the host in one copy and tested there: the
    scan waits for each device once, and launches no kernel but ``aminmax`` (a kernel's first
    launch in a process costs milliseconds, which the load would pay for each test kernel).
    """
    finish_scan_warm_up()
    suspects, groups = [], {}
    for index, tensor in enumerate(tensors):
        if tensor.is_floating_point() and tensor.numel():
            groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for (device, dtype), indices in groups.items():
        extremes = torch.empty((len(indices), 2), dtype=dtype, device=device)
        reduced = []
        for row, index in zip(extremes, indices):
            try:
                _extremes_into(tensors[index], row)
                reduced.append(True)
            except (NotImplementedError, RuntimeError):  # dtypes without aminmax (float8)
                reduced.append(False)
        # fp64 holds every float dtype's values exactly, and float8 has no isfinite.
        finite = torch.isfinite(extremes.cpu().double()).all(dim=1).tolist()
        suspects += [i for i, ok, done in zip(indices, finite, reduced) if not (ok and done)]
    return sorted(suspects)


def host_value(tensor: torch.Tensor) -> Any:
    """The Python number of a one-element tensor, read through a plain host copy.

    ``.item()`` on an accelerator tensor stages the value in pinned host memory, which the
    caching host allocator then keeps: a load would leave pinned memory behind it.
    """
    return tensor.detach().reshape(()).cpu().item()


def nonfinite_policy() -> str:
    """The configured answer to non-finite loaded state (see the module docstring)."""
    policy = os.environ.get(NONFINITE_POLICY_ENV, "error").strip().lower() or "error"
    if policy not in NONFINITE_POLICIES:
        raise ValueError(
            f"{NONFINITE_POLICY_ENV}={policy!r}: expected one of {', '.join(NONFINITE_POLICIES)}"
        )
    return policy


def scan_nonfinite(tensors: Iterable[Tuple[str, str, Any]], source: str) -> None:
    """Count the non-finite values of each loaded tensor and act as the policy says (nothing
    is read under ``ignore``).

    Args:
        tensors: ``(parameter, state key, value)``; values that are not tensors are skipped.
        source: what is being loaded, for the message.
    """
    if nonfinite_policy() == "ignore":
        return
    named = [entry for entry in tensors if isinstance(entry[2], torch.Tensor)]
    found = []
    for index in nonfinite_suspects([value for _, _, value in named]):
        param, key, value = named[index]
        bad = count_nonfinite(value)
        if bad:
            found.append((param, key, bad))
    report_nonfinite(found, source)


def plan_optimizer_state_dict(
    state_dict: Any,
    param_groups: Sequence[dict],
    name: str,
    live_keys: Iterable[str] = (),
    optional_keys: Iterable[str] = ("step",),
    own_tensors: Iterable[int] = (),
) -> dict:
    """Check a torch-style optimizer state dict against ``param_groups``, changing nothing.

    Checked: the ``state`` and ``param_groups`` keys, the group and parameter counts (paired
    in order, as torch pairs them), that every entry names a listed parameter, that all
    entries hold the same state keys (and ``live_keys``) but for ``optional_keys``, step
    counters (:func:`step_value`), state shapes (:func:`check_state_shape`), and non-finite
    values (:func:`scan_nonfinite`; the local shard of a DTensor).

    Args:
        state_dict: what ``optimizer.state_dict()`` returned.
        param_groups: the optimizer's groups.
        name: what is loading, for the messages.
        live_keys: state keys the optimizer already keeps for its parameters.
        optional_keys: keys an entry may lack (and that are no per-element state).
        own_tensors: ``id()`` of tensors the optimizer itself holds (its own state coming
            back), which are not scanned again.

    Returns:
        dict: parameter -> a copy of its saved entry, number steps made tensors (as torch's
        Adam makes them).

    Raises:
        KeyError, ValueError: naming the problem and the parameter's id in the checkpoint.
    """
    for required in ("state", "param_groups"):
        if required not in state_dict:
            raise KeyError(f"{name}: the state dict has no '{required}' key")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"{name}: the checkpoint has {len(saved_groups)} param groups, "
            f"this optimizer has {len(param_groups)}"
        )
    id_to_param = {}
    for index, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"{name}: param group {index} has {len(saved['params'])} "
                f"parameters in the checkpoint and {len(group['params'])} here"
            )
        if saved.get("step") is not None:
            step_value(saved["step"], f"{name}: param group {index}")
        id_to_param.update(zip(saved["params"], group["params"]))
    optional = set(optional_keys)
    expected = set(live_keys) - optional
    expected |= {k for e in state_dict["state"].values() for k in e if k not in optional}
    own = set(own_tensors)
    planned, loaded = {}, []
    for param_id, entry in state_dict["state"].items():
        param = id_to_param.get(param_id)
        where = f"{name}: parameter {param_id!r}"
        if param is None:
            raise KeyError(f"{where} has state in the checkpoint but no param group lists it")
        missing = sorted(expected - set(entry))
        if missing:
            raise KeyError(f"{where} lacks state {missing} that the others have")
        planned[param] = values = dict(entry)
        for key, value in entry.items():
            if key == "step":
                step = step_value(value, where)
                if not isinstance(step, torch.Tensor):
                    values[key] = torch.tensor(float(step), dtype=torch.float32)
            elif isinstance(value, torch.Tensor):
                check_state_shape(value, param.shape, key, where)
                if id(value) not in own:
                    local = (
                        value.to_local() if callable(getattr(value, "to_local", None)) else value
                    )
                    loaded.append((f"parameter {param_id!r}", key, local))
    scan_nonfinite(loaded, f"the {name} state dict")
    return planned


def report_nonfinite(found: List[Tuple[str, str, int]], source: str) -> None:
    """Act on non-finite values found in a checkpoint, as the policy says.

    Args:
        found: ``(parameter, state key, count)`` for each tensor with any.
        source: what is being loaded (a file, a state dict), for the message.

    Raises:
        ValueError: under the ``error`` policy, listing the first tensors found.
    """
    policy = nonfinite_policy()
    if not found or policy == "ignore":
        return
    listed = ", ".join(f"{param} '{key}': {count}" for param, key, count in found[:5])
    more = f" and {len(found) - 5} more tensors" if len(found) > 5 else ""
    message = (
        f"{source} holds non-finite optimizer state ({listed}{more}); training from it would "
        f"give NaN parameters. Set {NONFINITE_POLICY_ENV}=warn to load it anyway."
    )
    if policy == "error":
        raise ValueError(message)
    logger.warning(message)


class LoadGuard:
    """Marks an optimizer unusable while a load is writing, until that load completes.

    Args:
        owner: what the messages name (the optimizer's class name).
    """

    def __init__(self, owner: str):
        self.owner = owner
        self.failure: Optional[str] = None
        self._depth = 0

    @property
    def busy(self) -> bool:
        """Whether a load's writes are running (and enclose the caller)."""
        return self._depth > 0

    @contextlib.contextmanager
    def writing(self, what: str):
        """Run the writes of a load: a failure inside leaves the mark; the success of the
        outermost write clears it, whatever an earlier load left."""
        if self._depth == 0:
            self.failure = f"{what} did not complete"
        self._depth += 1
        try:
            yield
        except BaseException as error:
            self.failure = (
                f"{what} failed while writing the state ({type(error).__name__}: {error})"
            )
            raise
        finally:
            self._depth -= 1
        if self._depth == 0:
            self.failure = None

    def pending(self, what: str) -> None:
        """Mark the state as not loaded yet (``what`` says what is missing) until the next
        complete load."""
        self.failure = what

    def check(self, action: str) -> None:
        """Refuse ``action`` (a step, a save) while a failed load's mark is set.

        Raises:
            RuntimeError: saying which load failed and that a complete load clears it.
        """
        if self.failure is not None:
            raise RuntimeError(
                f"{self.owner}: cannot {action}: {self.failure}, so the optimizer state is "
                f"partly the checkpoint's; load a checkpoint again (a complete load clears this)"
            )
