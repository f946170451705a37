# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Loads are checked before they change anything, and a load that fails while writing leaves
an optimizer that says so.

One table of bad inputs drives one test per optimizer: the HybridDeviceOptimizer alone (fp32
and bf16 parameters) and the DistributedOptimizer over torch AdamW and over the HDO (CPU
buffers, no process group). Each bad input must raise a clear error, and the optimizer must
then be as before: state, master copies, hyperparameters, step counters and parameters equal,
and the next steps equal to a twin's that never saw it. Faults injected into each phase of a
load show what a failure there leaves, and many load cycles must not grow memory.
"""

import gc
import io
import math
import threading
from unittest import mock

import pytest
import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

flows = optimizer_table.sibling("hdo_client_flows")
core = optimizer_table.sibling("test_distrib_optimizer_core")
fixture_cpu_as_cuda = optimizer_table.sibling("test_distrib_optimizer_core").fixture_cpu_as_cuda

checks = pytest.importorskip("megatron.core.optimizer.state_load_checks")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(8, 4), (16,), (4, 4), (3,), (6, 2)]


# --------------------------------------------------------------------------------------------
# The HybridDeviceOptimizer alone
# --------------------------------------------------------------------------------------------


def make_hdo(dtype, seed=0, fraction=0.5):
    return flows.build_hdo(HybridDeviceOptimizer, SHAPES, fraction, seed, dtype, DEVICE)


train_hdo = flows.train_params


def saved_hdo(dtype):
    """A checkpoint of a trained HDO (as bytes come back from disk)."""
    params, optimizer = make_hdo(dtype, seed=3)
    train_hdo(params, optimizer, 3, seed=4)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _entry(state_dict, index=0):
    return state_dict["state"][index]


def _put(key, value):
    return lambda sd: _entry(sd).__setitem__(key, value)


def _poison(key, value):
    def corrupt(sd):
        _entry(sd)[key].view(-1)[1] = value

    return corrupt


def _transpose_first(sd):
    # (8, 4) -> (4, 8): the same elements, which an element-order reshape would scramble.
    _entry(sd)["exp_avg"] = _entry(sd)["exp_avg"].reshape(4, 8).clone()


# name -> (corruption, expected exception, message pattern)
HDO_BAD_INPUTS = {
    "step_none": (_put("step", None), ValueError, "step counter is None"),
    "step_fraction": (_put("step", 2.5), ValueError, "not a whole count"),
    "step_negative": (_put("step", torch.tensor(-1.0)), ValueError, "not a whole count"),
    "step_nan": (_put("step", torch.tensor(math.nan)), ValueError, "not a whole count"),
    "step_of_two_values": (_put("step", torch.ones(2)), ValueError, "tensor of shape"),
    "group_step_negative": (
        lambda sd: sd["param_groups"][0].__setitem__("step", -3),
        ValueError,
        "param group 0",
    ),
    "transposed_moment": (_transpose_first, ValueError, "shape \\(4, 8\\)"),
    "zero_dim_moment": (_put("exp_avg", torch.tensor(0.5)), ValueError, "shape \\(\\)"),
    "missing_moment": (lambda sd: _entry(sd).pop("exp_avg_sq"), KeyError, "exp_avg_sq"),
    "nan_in_moment": (_poison("exp_avg", math.nan), ValueError, "non-finite"),
    "inf_in_master": (_poison("master_param", math.inf), ValueError, "non-finite"),
    "group_count": (lambda sd: sd["param_groups"].pop(), ValueError, "param groups"),
    "param_count": (lambda sd: sd["param_groups"][1]["params"].pop(), ValueError, "group 1"),
    "unlisted_param": (lambda sd: sd["state"].__setitem__(99, {}), KeyError, "99"),
    "no_state": (lambda sd: sd.pop("state"), KeyError, "'state'"),
}


def _hdo_snapshot(params, optimizer):
    """Everything a refused load must leave as it was, with the objects that hold it."""
    state = {
        (index, key): (value, value.detach().clone())
        for index, param in enumerate(params)
        for key, value in optimizer.state[param].items()
        if isinstance(value, torch.Tensor)
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return state, groups, [p.detach().clone() for p in params]


def _assert_hdo_as_before(params, optimizer, snapshot):
    state, groups, values = snapshot
    now, now_groups, now_values = _hdo_snapshot(params, optimizer)
    assert now.keys() == state.keys()
    for key, (tensor, value) in state.items():
        assert now[key][0] is tensor and torch.equal(tensor, value), key
    assert now_groups == groups
    assert all(torch.equal(a, b) for a, b in zip(now_values, values))


@pytest.mark.parametrize("bad", sorted(HDO_BAD_INPUTS))
@pytest.mark.parametrize("dtype", optimizer_table.dtype_params())
def test_a_bad_hdo_checkpoint_is_refused_and_changes_nothing(dtype, bad):
    corrupt, error, message = HDO_BAD_INPUTS[bad]
    params, optimizer = make_hdo(dtype)
    twin_params, twin = make_hdo(dtype)
    train_hdo(params, optimizer, 2, seed=1)
    train_hdo(twin_params, twin, 2, seed=1)
    state_dict = saved_hdo(dtype)
    corrupt(state_dict)
    snapshot = _hdo_snapshot(params, optimizer)
    with pytest.raises(error, match=message):
        optimizer.load_state_dict(state_dict)
    _assert_hdo_as_before(params, optimizer, snapshot)
    train_hdo(params, optimizer, 2, seed=2)
    train_hdo(twin_params, twin, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))


def test_whole_numbers_load_as_steps_like_torch_converts_them():
    params, optimizer = make_hdo(torch.float32)
    twin_params, twin = make_hdo(torch.float32)
    state_dict = saved_hdo(torch.float32)
    twin.load_state_dict(state_dict)
    numbers = saved_hdo(torch.float32)
    for entry in numbers["state"].values():
        entry["step"] = int(entry["step"])
    optimizer.load_state_dict(numbers)
    assert all(torch.is_tensor(optimizer.state[p]["step"]) for p in params)
    train_hdo(params, optimizer, 2, seed=2)
    train_hdo(twin_params, twin, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))


def test_non_finite_state_loads_with_a_warning_when_told(monkeypatch, caplog):
    monkeypatch.setenv(checks.NONFINITE_POLICY_ENV, "warn")
    _, optimizer = make_hdo(torch.float32)
    state_dict = saved_hdo(torch.float32)
    _poison("exp_avg", math.nan)(state_dict)
    with caplog.at_level("WARNING"):
        optimizer.load_state_dict(state_dict)
    assert "non-finite" in caplog.text and "parameter 0 'exp_avg': 1" in caplog.text
    monkeypatch.setenv(checks.NONFINITE_POLICY_ENV, "sometimes")
    with pytest.raises(ValueError, match="expected one of error, warn, ignore"):
        optimizer.load_state_dict(saved_hdo(torch.float32))


def _scan_inputs():
    """Tensors of every floating dtype a state holds, some with one bad element, and values
    the scan must pass over (integers, empty tensors, extremes beyond fp32's range)."""
    generator = torch.Generator().manual_seed(0)
    tensors, bad = [], []
    for index, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float64]):
        for poison in (None, math.nan, math.inf, -math.inf):
            tensor = torch.randn(300, generator=generator).to(DEVICE, dtype)
            if poison is not None:
                tensor[(index * 37) % 300] = poison
                bad.append(len(tensors))
            tensors.append(tensor)
    tensors.append(torch.full((5,), 1e300, dtype=torch.float64, device=DEVICE))
    tensors.append(torch.arange(6, device=DEVICE))
    tensors.append(torch.empty(0, device=DEVICE))
    return tensors, bad


def test_the_non_finite_scan_finds_each_bad_tensor_among_mixed_dtypes():
    tensors, bad = _scan_inputs()
    assert checks.nonfinite_suspects(tensors) == bad
    assert [checks.count_nonfinite(tensors[index]) for index in bad] == [1] * len(bad)
    with pytest.raises(ValueError, match="non-finite") as raised:
        checks.scan_nonfinite([("p", str(i), t) for i, t in enumerate(tensors)], "the test")
    assert all(f"'{index}': 1" in str(raised.value) for index in bad[:5])
    assert f"and {len(bad) - 5} more tensors" in str(raised.value)


def test_fp64_state_beyond_fp32_s_range_is_counted_in_fp64():
    values = torch.full((10,), 1e300, dtype=torch.float64, device=DEVICE)
    values[3] = math.nan
    assert checks.nonfinite_suspects([values]) == [0]
    assert checks.count_nonfinite(values) == 1


def test_the_non_finite_scan_reads_each_device_and_dtype_back_once(monkeypatch):
    """Waiting for the device once per tensor, and testing the extremes there with kernels
    launched for the first time in the process, made the scan of a 134M-parameter state take
    0.05-0.07 s on an H200, as long as the rest of the second load pass."""
    tensors, _ = _scan_inputs()
    clean = [t for t in tensors if t.is_floating_point() and t.numel() and torch.isfinite(t).all()]
    clean += [t.clone() for t in clean] + [t.clone() for t in clean]
    reads = []
    original = torch.Tensor.cpu

    def counted(tensor, *args, **kwargs):
        reads.append((tensor.dtype, tuple(tensor.shape)))
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    checks.scan_nonfinite([("p", str(i), t) for i, t in enumerate(clean)], "the test")
    dtypes = {t.dtype for t in clean}
    assert len(clean) > 2 * len(dtypes)
    assert sorted(reads, key=str) == sorted(
        ((d, (sum(t.dtype == d for t in clean), 2)) for d in dtypes), key=str
    )


def warm_up_threads():
    """The scan's warm-up threads not joined yet (internal: no public member lists them)."""
    return checks._scan_warm_up  # pylint: disable=protected-access


@pytest.mark.skipif(not torch.cuda.is_available(), reason="kernels load lazily on CUDA only")
def test_the_scan_s_kernel_is_first_launched_on_a_warm_up_thread(monkeypatch):
    """A kernel's first launch in a process costs milliseconds of host time; the warm-up
    pays it on a thread of its own, once per device and dtype, before the scan launches."""
    monkeypatch.setattr(checks, "_scan_kernels_loaded", set())
    launches = []
    extremes_into = checks._extremes_into

    def recorded(tensor, row):
        launches.append((threading.current_thread().name, tensor.device, tensor.dtype))
        extremes_into(tensor, row)

    monkeypatch.setattr(checks, "_extremes_into", recorded)
    tensors = [
        torch.ones(5, dtype=torch.bfloat16, device="cuda"),
        torch.ones(3, dtype=torch.float16, device="cuda"),
        torch.arange(4, device="cuda"),
        torch.ones(2),
    ]
    checks.warm_up_nonfinite_scan(tensors)
    checks.warm_up_nonfinite_scan(tensors)  # a second optimizer's, while the first may run
    assert checks.nonfinite_suspects(tensors) == []
    device = tensors[0].device
    warmed = {(d, t) for name, d, t in launches if name == "nonfinite-scan-warm-up"}
    assert warmed == {(device, torch.bfloat16), (device, torch.float16), (device, torch.float32)}
    assert sum(name == "nonfinite-scan-warm-up" for name, _, _ in launches) == len(warmed)
    assert {name for name, _, _ in launches[: len(warmed)]} == {"nonfinite-scan-warm-up"}
    assert len(launches) == len(warmed) + 3  # the scan's own launches, after the warm-up
    launches.clear()
    checks.warm_up_nonfinite_scan(tensors)  # loaded already: nothing to launch again
    checks.nonfinite_suspects(tensors)
    assert [name for name, _, _ in launches] == [threading.current_thread().name] * 3
    monkeypatch.setattr(checks, "_scan_kernels_loaded", set())
    monkeypatch.setenv(checks.NONFINITE_POLICY_ENV, "ignore")  # no scan, so no warm-up
    checks.warm_up_nonfinite_scan(tensors)
    assert not warm_up_threads()


@pytest.mark.usefixtures("cpu_as_cuda")
def test_a_dist_checkpoint_request_starts_the_scan_s_warm_up_on_the_live_state(monkeypatch):
    model, optimizer = core.build(core.fork)
    core.train_step(optimizer, model, 0)
    handed = []
    monkeypatch.setattr(checks, "warm_up_nonfinite_scan", handed.append)
    optimizer.sharded_state_dict({}, is_loading=True, metadata=core.DP_RESHARDABLE)
    (tensors,) = handed
    inner = optimizer.optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    assert {id(p) for p in params} <= {id(t) for t in tensors}
    first_state = inner.state[inner.param_groups[0]["params"][0]]
    assert {id(v) for v in first_state.values()} <= {id(t) for t in tensors}


def test_the_warm_up_never_fails_a_load_request(monkeypatch):
    """It is an optimisation: no thread to be had, or a bad policy (the scan reports it), and
    the request goes on and the scan works."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_thread(thread):
        raise RuntimeError("can't start new thread")

    with mock.patch.object(threading.Thread, "start", no_thread):
        checks.warm_up_nonfinite_scan([torch.ones(2)])
    assert not warm_up_threads()
    assert checks.nonfinite_suspects([torch.ones(2)]) == []
    monkeypatch.setenv(checks.NONFINITE_POLICY_ENV, "sometimes")
    checks.warm_up_nonfinite_scan([torch.ones(2)])
    with pytest.raises(ValueError, match="sometimes"):
        checks.scan_nonfinite([("p", "exp_avg", torch.ones(2))], "the test")


@pytest.mark.usefixtures("cpu_as_cuda")
def test_a_load_leaves_no_warm_up_thread_behind_even_without_a_scan(monkeypatch):
    _, _, state_dict = saved_distopt("torch_adamw")
    model, optimizer = build_distopt("torch_adamw")
    core.train_step(optimizer, model, 0)
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        optimizer.sharded_state_dict({}, is_loading=True, metadata=core.DP_RESHARDABLE)
    assert warm_up_threads()  # the request started one
    monkeypatch.setenv(checks.NONFINITE_POLICY_ENV, "ignore")  # so load_state_dict scans nothing
    optimizer.load_state_dict(state_dict)
    assert not warm_up_threads()


def test_float8_state_is_scanned_too():
    float8 = getattr(torch, "float8_e4m3fn", None)
    if float8 is None:
        pytest.skip("no float8 in this torch")
    values = torch.tensor([1.0, -2.0, 448.0, math.nan], device=DEVICE)
    tensors = [values[:3].to(float8), values.to(float8)]
    # Where aminmax has no float8 kernel every float8 tensor is a suspect, counted exactly.
    assert 1 in checks.nonfinite_suspects(tensors)
    assert [checks.count_nonfinite(t) for t in tensors] == [0, 1]
    with pytest.raises(ValueError, match="non-finite") as raised:
        checks.scan_nonfinite([("p", str(i), t) for i, t in enumerate(tensors)], "the test")
    assert "'1': 1" in str(raised.value) and "'0'" not in str(raised.value)


def _fail_on_call(number, exception=RuntimeError("injected fault")):
    """A function that raises on its ``number``-th call and calls through otherwise."""
    calls = []

    def wrap(original):
        def call(*args, **kwargs):
            calls.append(1)
            if len(calls) == number:
                raise exception
            return original(*args, **kwargs)

        return call

    return wrap


@pytest.mark.parametrize("phase", ["plan", "commit", "finish"])
def test_a_fault_in_each_phase_of_an_hdo_load(phase, monkeypatch):
    """A fault in the plan leaves the optimizer usable and as it was; one in the writes or
    the finish leaves it refusing to step or save until a complete load, which then resumes
    exactly."""
    params, optimizer = make_hdo(torch.bfloat16)
    train_hdo(params, optimizer, 2, seed=1)
    source_params, source = make_hdo(torch.bfloat16, seed=3)
    train_hdo(source_params, source, 3, seed=4)
    state_dict = source.state_dict()
    target = {
        "plan": (checks, "nonfinite_suspects"),
        "commit": (HybridDeviceOptimizer, "_settle"),
        "finish": (HybridDeviceOptimizer, "_hand_back_group_steps"),
    }[phase]
    monkeypatch.setattr(*target, _fail_on_call(3 if phase == "commit" else 1)(getattr(*target)))
    snapshot = _hdo_snapshot(params, optimizer)
    with pytest.raises(RuntimeError, match="injected fault"):
        optimizer.load_state_dict(state_dict)
    monkeypatch.undo()
    if phase == "plan":
        _assert_hdo_as_before(params, optimizer, snapshot)
        train_hdo(params, optimizer, 1, seed=2)
        return
    with pytest.raises(RuntimeError, match="load_state_dict did not complete"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="load a checkpoint again"):
        optimizer.state_dict()
    optimizer.load_state_dict(state_dict)
    with torch.no_grad():
        for param, source_param in zip(params, source_params):
            param.copy_(source_param)
    train_hdo(params, optimizer, 2, seed=5)
    train_hdo(source_params, source, 2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(params, source_params))


def _live_tensors():
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def _host_bytes():
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_a_hundred_hdo_load_cycles_keep_memory_and_tensor_count_flat():
    params, optimizer = make_hdo(torch.bfloat16)
    state_dict = saved_hdo(torch.bfloat16)
    optimizer.load_state_dict(state_dict)
    train_hdo(params, optimizer, 1, seed=1)
    start = _live_tensors(), _host_bytes()
    for cycle in range(100):
        optimizer.load_state_dict(state_dict)
        train_hdo(params, optimizer, 1, seed=2 + cycle)
    assert (_live_tensors(), _host_bytes()) == start


# --------------------------------------------------------------------------------------------
# The DistributedOptimizer (CPU buffers, torch AdamW or the HDO inside)
# --------------------------------------------------------------------------------------------


def _hdo_inner(groups, lr):
    return core._hybrid(groups, lr, param_update_in_fp32=True)  # pylint: disable=protected-access


INNERS = {"torch_adamw": torch.optim.AdamW, "hdo": _hdo_inner}


def build_distopt(inner, seed=0, bucket_size=None):
    return core.build(core.fork, 1, 0, bucket_size, optimizer_cls=INNERS[inner], seed=seed)


def saved_distopt(inner, bucket_size=None):
    """A dp_reshardable optimizer state dict of a trained optimizer, as a checkpoint holds it."""
    model, optimizer = build_distopt(inner, seed=3, bucket_size=bucket_size)
    for seed in range(3):
        core.train_step(optimizer, model, seed)
    state_dict = {
        **optimizer.state_dict(),
        "param_state": optimizer.get_parameter_state_dp_reshardable(),
        "param_state_sharding_type": "dp_reshardable",
    }
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return model, optimizer, torch.load(buffer, weights_only=False)


def _first_piece(state_dict):
    return state_dict["param_state"][0][next(iter(state_dict["param_state"][0]))][0][0]


def _another_model(state_dict, inner):
    _, _, other = saved_distopt(inner, bucket_size=40)
    state_dict["param_state"] = other["param_state"]


def _set_lr_and(corrupt):
    """Every bad input also carries another learning rate, which a refused load must not
    leave behind."""

    def apply(state_dict, inner):
        for group in state_dict["optimizer"]["param_groups"]:
            group["lr"] = 0.5
        corrupt(state_dict, inner)

    return apply


DISTOPT_BAD_INPUTS = {
    "another_model_dp_reshardable": (_another_model, ValueError, "another model"),
    "nan_in_param_state": (
        lambda sd, _: _first_piece(sd)["exp_avg"].view(-1).__setitem__(0, math.nan),
        ValueError,
        "non-finite",
    ),
    "group_step_negative": (
        lambda sd, _: [g.__setitem__("step", -1.0) for g in sd["optimizer"]["param_groups"]],
        ValueError,
        "not a whole count",
    ),
    "missing_moment": (lambda sd, _: _first_piece(sd).pop("exp_avg_sq"), KeyError, "exp_avg_sq"),
    "piece_not_flat": (
        lambda sd, _: _first_piece(sd).__setitem__(
            "exp_avg", _first_piece(sd)["exp_avg"].reshape(1, -1)
        ),
        ValueError,
        "only that shape or its flat",
    ),
    "sharding_type_unknown": (
        lambda sd, _: sd.__setitem__("param_state_sharding_type", "nope"),
        NotImplementedError,
        "nope",
    ),
}


def _distopt_snapshot(optimizer):
    inner = optimizer.optimizer
    state = {
        (id(param), key): (value, value.detach().clone())
        for param, entry in inner.state.items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return state, groups, [b.param_data.clone() for b in optimizer.buffers]


def _assert_distopt_as_before(optimizer, snapshot):
    state, groups, buffers = snapshot
    now, now_groups, now_buffers = _distopt_snapshot(optimizer)
    assert now.keys() == state.keys()
    for key, (tensor, value) in state.items():
        assert now[key][0] is tensor and torch.equal(tensor, value), key
    assert now_groups == groups
    assert all(torch.equal(a, b) for a, b in zip(now_buffers, buffers))


def _train_alike(pairs, seeds):
    for seed in seeds:
        for model, optimizer in pairs:
            core.train_step(optimizer, model, seed)
    (model, _), (twin_model, _) = pairs
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))


@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("bad", sorted(DISTOPT_BAD_INPUTS))
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_a_bad_distributed_checkpoint_is_refused_and_changes_nothing(inner, bad):
    corrupt, error, message = DISTOPT_BAD_INPUTS[bad]
    pair = [build_distopt(inner), build_distopt(inner)]
    _train_alike(pair, range(2))
    (_, optimizer), _ = pair
    _, _, state_dict = saved_distopt(inner)
    _set_lr_and(corrupt)(state_dict, inner)
    snapshot = _distopt_snapshot(optimizer)
    with pytest.raises(error, match=message):
        optimizer.load_state_dict(state_dict)
    _assert_distopt_as_before(optimizer, snapshot)
    _train_alike(pair, range(2, 4))


@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("phase", ["commit", "finish", "hdo_commit"])
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_a_fault_while_a_distributed_load_writes(inner, phase, monkeypatch):
    """The plan phase is the bad-input table above; here the writes or the finish fail."""
    model, optimizer = build_distopt(inner)
    core.train_step(optimizer, model, 0)
    source_model, source, state_dict = saved_distopt(inner)
    if phase == "hdo_commit":
        if inner != "hdo":
            pytest.skip("a fault inside the HDO's own load")
        target = (HybridDeviceOptimizer, "_settle")
    else:
        method = {"commit": "write", "finish": "finish_load"}[phase]
        target = (type(optimizer.inner_state), method)
    monkeypatch.setattr(*target, _fail_on_call(2)(getattr(*target)))
    with pytest.raises(RuntimeError, match="injected fault"):
        optimizer.load_state_dict(state_dict)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="load_state_dict failed while writing"):
        optimizer.step_with_ready_grads()
    with pytest.raises(RuntimeError, match="load a checkpoint again"):
        optimizer.state_dict()
    optimizer.load_state_dict(state_dict)
    # A complete load clears the mark: saving works again.
    assert optimizer.state_dict()["optimizer"]["param_groups"]
    with torch.no_grad():
        for param, source_param in zip(model.parameters(), source_model.parameters()):
            param.copy_(source_param)
    _train_alike([(model, optimizer), (source_model, source)], range(3, 5))


@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_a_hundred_distributed_load_cycles_keep_memory_and_tensor_count_flat(inner):
    model, optimizer = build_distopt(inner)
    _, _, state_dict = saved_distopt(inner)
    optimizer.load_state_dict(state_dict)
    core.train_step(optimizer, model, 0)
    start = _live_tensors(), _host_bytes()
    for cycle in range(100):
        optimizer.load_state_dict(state_dict)
        core.train_step(optimizer, model, 1 + cycle)
    assert (_live_tensors(), _host_bytes()) == start


def _mixed_hdo(groups, lr):
    """Megatron's factory: TE/Apex FusedAdam in place (its step in the param groups, here
    GroupStepAdamW) and torch AdamW on the host (a step per parameter)."""
    return HybridDeviceOptimizer(
        groups,
        offload_fraction=0.5,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=core.GroupStepAdamW,
        param_update_in_fp32=True,
        lr=lr,
    )


def _mixed_hdo_over(seed):
    params, _ = make_hdo(torch.bfloat16, seed=seed)
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]
    return params, _mixed_hdo(groups, 1e-2)


def test_an_hdo_with_two_kinds_of_sub_optimizer_loads_its_own_checkpoint():
    source_params, source = _mixed_hdo_over(seed=3)
    train_hdo(source_params, source, 3, seed=4)
    assert any("step" in e for e in source.state.values())
    assert not all("step" in e for e in source.state.values())
    params, target = _mixed_hdo_over(seed=9)
    with torch.no_grad():
        for param, source_param in zip(params, source_params):
            param.copy_(source_param)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    target.load_state_dict(torch.load(buffer, weights_only=True))
    train_hdo(params, target, 2, seed=5)
    train_hdo(source_params, source, 2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(params, source_params))


@pytest.mark.usefixtures("cpu_as_cuda")
def test_a_distributed_optimizer_over_a_mixed_hdo_resumes():
    INNERS["mixed_hdo"] = _mixed_hdo
    try:
        model, optimizer = build_distopt("mixed_hdo")
        source_model, source, state_dict = saved_distopt("mixed_hdo")
        optimizer.load_state_dict(state_dict)
        with torch.no_grad():
            for param, source_param in zip(model.parameters(), source_model.parameters()):
                param.copy_(source_param)
        _train_alike([(model, optimizer), (source_model, source)], range(3, 5))
    finally:
        del INNERS["mixed_hdo"]


@pytest.mark.usefixtures("cpu_as_cuda")
def test_a_state_created_without_values_is_marked_until_the_parameter_state_loads():
    """The legacy flow loads the common state dict, then the parameter state; between the two
    the state exists but holds no values, and must not be stepped or saved."""
    model, optimizer = build_distopt("torch_adamw")
    _, _, state_dict = saved_distopt("torch_adamw")
    common = {k: v for k, v in state_dict.items() if not k.startswith("param_state")}
    optimizer.load_state_dict(common)
    with pytest.raises(RuntimeError, match="parameter state .* is not loaded yet"):
        optimizer.state_dict()
    optimizer.load_parameter_state_from_dp_reshardable(state_dict["param_state"])
    assert optimizer.state_dict()["optimizer"]["param_groups"]  # no mark left
    core.train_step(optimizer, model, 0)


@pytest.mark.usefixtures("cpu_as_cuda")
def test_a_refused_checkpoint_after_a_dist_checkpoint_read_marks_the_state():
    """The dist-checkpoint reader writes into the live state before load_state_dict checks
    anything; when that load then refuses the checkpoint, the state is partly the checkpoint's
    and must not be stepped or saved. Without a read, a refusal changes nothing."""
    _, optimizer = build_distopt("torch_adamw")
    _, _, state_dict = saved_distopt("torch_adamw")
    for group in state_dict["optimizer"]["param_groups"]:
        group["step"] = -1.0
    with pytest.raises(ValueError, match="not a whole count"):
        optimizer.load_state_dict(state_dict)
    assert optimizer.state_dict()["optimizer"]["param_groups"]  # no mark
    # The request of a dist-checkpoint read, whose reader then writes into the live state.
    optimizer.sharded_state_dict({}, is_loading=True, metadata=core.DP_RESHARDABLE)
    with pytest.raises(ValueError, match="not a whole count"):
        optimizer.load_state_dict(state_dict)
    with pytest.raises(RuntimeError, match="then load_state_dict refused the checkpoint"):
        optimizer.state_dict()


def test_every_format_is_one_registry_entry_naming_methods_of_upstreams_class():
    """The registry is the only dispatch: each format names methods both implementations
    have (the public builders and loaders are upstream's), and it loads what upstream's
    load_state_dict loads."""
    formats = pytest.importorskip("megatron.core.optimizer.distrib_optimizer_formats")
    if core.UPSTREAM is None:
        pytest.skip("upstream's module is not available beside the fork's")
    upstream = core.UPSTREAM.DistributedOptimizer
    for name, fmt in formats.FORMATS.items():
        assert fmt.name == name and formats.format_named(name) is fmt
        for method in (fmt.builder, fmt.loader):
            if method is not None:
                assert callable(getattr(upstream, method)) and callable(
                    getattr(core.fork.DistributedOptimizer, method)
                ), method
        if fmt.loadable:
            assert callable(getattr(core.fork.DistributedOptimizer, fmt.planner))
    loadable = {name for name, fmt in formats.FORMATS.items() if fmt.loadable}
    assert loadable == {
        "dp_zero_gather_scatter",
        "fully_reshardable",
        "dp_reshardable",
        "fully_sharded_model_space",
    }
    assert formats.LAYOUT_FREE_FORMATS == upstream.checkpoint_fully_reshardable_formats
    with pytest.raises(NotImplementedError, match="Unknown sharding_type: fully_sharded_bucket"):
        formats.format_named("fully_sharded_bucket_space")


@pytest.mark.usefixtures("cpu_as_cuda")
def test_load_state_dict_writes_through_the_loader_a_client_wrapped():
    """Clients wrap the public loaders (to log, time or patch them): the load goes through the
    wrapper on the instance, with the plan made before anything changed."""
    _, _, state_dict = saved_distopt("torch_adamw")
    _, optimizer = build_distopt("torch_adamw", seed=5)
    calls = []
    original = optimizer.load_parameter_state_from_dp_reshardable

    def wrapper(param_state):
        calls.append(param_state)
        return original(param_state)

    optimizer.load_parameter_state_from_dp_reshardable = wrapper
    optimizer.load_state_dict(state_dict)
    assert calls == [state_dict["param_state"]]
