# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Exactness and lifetime tests for HybridDeviceOptimizer.

Every test runs on the CPU (the optimizer then steps its offloaded share on plain host
copies); where CUDA exists the same tests use accelerator parameters, pinned copies and
side streams. Run them against upstream's module with ``MEGATRON_OPTIMIZER_FORK=0``.
"""

import gc
import importlib
import io

import pytest
import torch

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

_optimizer_doubles = optimizer_table.sibling("optimizer_doubles")
upstream_modules = optimizer_table.sibling("upstream_modules")
GroupStepAdamW = _optimizer_doubles.GroupStepAdamW
te_fused_adam = _optimizer_doubles.te_fused_adam

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SHAPES = [(8, 4), (16,), (4, 4), (3,), (6, 2)]
FRACTIONS = optimizer_table.OFFLOAD_FRACTIONS
DTYPES = optimizer_table.DTYPES
DeviceAdamW = optimizer_table.DeviceAdamW


def make_params(dtype, seed=0):
    """A few parameters of assorted shapes, as a model would hand them over."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(DEVICE, dtype))
        for shape in SHAPES
    ]


def make_optimizer(params, fraction, inner="torch_adamw", **overrides):
    """An HDO with two param groups (the second with weight decay), as Megatron builds it."""
    options = dict(
        offload_fraction=fraction,
        cpu_optimizer_cls=optimizer_table.inner_optimizer(inner),
        gpu_optimizer_cls=optimizer_table.inner_optimizer(inner),
        param_update_in_fp32=True,
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    options.update(overrides)
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]
    return HybridDeviceOptimizer(groups, **options)


def train(params, optimizer, steps, seed):
    """Take ``steps`` steps with reproducible gradients drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(DEVICE, param.dtype)
        optimizer.step()
        optimizer.zero_grad()


def checkpoint(optimizer):
    """Round-trip the optimizer's state dict through bytes, as a checkpoint would.

    ``weights_only=False`` lets upstream's state dicts (classes in their groups) through, so
    a run against upstream fails on behaviour; weights-only loading has a test of its own.
    """
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def copy_params(dst, src):
    """Restore model parameters, as a model checkpoint load does."""
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)


def assert_equal_params(actual, expected):
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(
            a, e
        ), f"parameter {index} differs by {(a.float() - e.float()).abs().max()}"


def identities(optimizer):
    """The objects that must survive a load: inner tensors, sub-optimizers, grad buffers."""
    return (
        [id(t) for t in optimizer.param_to_inner_param.values()],
        [id(o) for o in optimizer.sub_optimizers],
        {id(k): id(v) for k, v in optimizer.cpu_copy_map_grad.items()},
    )


def host_buckets(optimizer):
    """The HDO's host buckets in step order, built on first use (internal: no public member
    gives them)."""
    return optimizer._buckets  # pylint: disable=protected-access


def ring_plan(optimizer):
    """The plan of the HDO's ring of gradient slots (internal: no public member gives it)."""
    return optimizer._ring.plan  # pylint: disable=protected-access


def plan_pins_within_0_19_2s_budget(monkeypatch):
    """Has the fork plan its pinned host memory within what megatron-core 0.19.2 pins, whatever
    megatron-core is around it (nothing on upstream's module, which plans nothing).

    0.19.2 leaves an offloaded parameter's widened fp32 copy pageable; Megatron-LM main pins it,
    and a budget that holds those copies pins every host copy of a small test model, so the
    ring's handling of pageable copies would go untested there.
    """
    try:
        plan = importlib.import_module(f"{hybrid_optimizer.__package__}.hybrid_optimizer_plan")
    except ModuleNotFoundError:
        return
    monkeypatch.setattr(plan, "upstream_pins_widened_copies", lambda: False)


def inner_tensor(optimizer, param):
    """The tensor that holds ``param``'s optimizer state (fork and upstream alike)."""
    if param in optimizer.param_to_fp32_param:
        return optimizer.param_to_fp32_param[param]
    return optimizer.gpu_params_map_cpu_copy.get(param, param)


@pytest.mark.parametrize("inner", optimizer_table.inner_params())
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_load_state_dict_reuses_the_cpu_copies_and_resumes_exactly(dtype, fraction, inner):
    # The run that is checkpointed and goes on uninterrupted.
    params = make_params(dtype)
    optimizer = make_optimizer(params, fraction, inner)
    train(params, optimizer, 3, seed=1)
    saved = checkpoint(optimizer)
    saved_params = [p.detach().clone() for p in params]
    train(params, optimizer, 2, seed=2)

    # A second optimizer that has already stepped (so its buffers exist) resumes.
    resumed_params = make_params(dtype, seed=7)
    resumed = make_optimizer(resumed_params, fraction, inner)
    train(resumed_params, resumed, 1, seed=9)
    before = identities(resumed)
    copy_params(resumed_params, saved_params)
    resumed.load_state_dict(saved)

    assert identities(resumed) == before
    for param in resumed_params:
        inner_param = resumed.param_to_inner_param[param]
        for key, value in resumed.state[param].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device == inner_param.device, (key, value.device)
    train(resumed_params, resumed, 2, seed=2)
    assert_equal_params(resumed_params, params)
    for param, resumed_param in zip(params, resumed_params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed.state[resumed_param][key], optimizer.state[param][key])


@pytest.mark.parametrize("inner", optimizer_table.inner_params())
def test_the_adam_step_counter_survives_the_checkpoint(inner):
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, 0.5, inner)
    train(params, optimizer, 4, seed=1)
    saved = checkpoint(optimizer)
    if inner == "group_step_adamw":
        assert [group["step"] for group in saved["param_groups"]] == [4, 4]
    else:
        assert {float(entry["step"]) for entry in saved["state"].values()} == {4.0}

    resumed_params = make_params(torch.bfloat16, seed=3)
    resumed = make_optimizer(resumed_params, 0.5, inner)
    resumed.load_state_dict(saved)
    for sub_optimizer in resumed.sub_optimizers:
        for group in sub_optimizer.param_groups:
            if inner == "group_step_adamw":
                assert group["step"] == 4
            else:
                for param in group["params"]:
                    assert float(sub_optimizer.state[param]["step"]) == 4.0


@pytest.mark.parametrize("inner", optimizer_table.inner_params())
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_hyperparameters_set_between_steps_reach_every_sub_optimizer(fraction, inner):
    """A scheduler writes the public groups' lr and weight decay before each step; the step
    must use them on every parameter, offloaded or not. With both at zero Adam moves nothing,
    so any sub-optimizer still on the old values changes its parameters."""
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, fraction, inner)
    train(params, optimizer, 2, seed=1)
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    frozen = [p.detach().clone() for p in params]
    train(params, optimizer, 1, seed=2)
    assert_equal_params(params, frozen)
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    train(params, optimizer, 1, seed=3)
    assert all(not torch.equal(p, f) for p, f in zip(params, frozen))


def test_a_checkpoint_without_the_group_step_loads_as_before():
    params = make_params(torch.float32)
    optimizer = make_optimizer(params, 0.5, "torch_adamw")
    train(params, optimizer, 2, seed=1)
    saved = checkpoint(optimizer)
    for group in saved["param_groups"]:
        group.pop("step", None)
    resumed_params = make_params(torch.float32)
    resumed = make_optimizer(resumed_params, 0.5, "torch_adamw")
    copy_params(resumed_params, params)
    resumed.load_state_dict(saved)
    train(params, optimizer, 1, seed=2)
    train(resumed_params, resumed, 1, seed=2)
    assert_equal_params(resumed_params, params)


def _host_tensor_footprint():
    """Bytes and count of distinct host storages alive, and how many are pinned."""
    storages = {}
    # type(), not isinstance: isinstance falls back to obj.__class__, which some objects guard
    # (main's experimental-class interceptors raise) and some torch module objects warn on.
    tensors = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]
    for obj in tensors:
        if obj.device.type != "cpu":
            continue
        storage = obj.untyped_storage()
        storages[storage.data_ptr()] = (storage.nbytes(), obj.is_pinned())
    nbytes = sum(size for size, _ in storages.values())
    return nbytes, len(storages), sum(pinned for _, pinned in storages.values())


def _pinned_allocations():
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.memory.host_memory_stats().get("allocations.current", 0)


@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_twenty_load_cycles_keep_host_memory_and_pinned_buffers_flat(fraction):
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, fraction)
    train(params, optimizer, 2, seed=1)
    optimizer.load_state_dict(checkpoint(optimizer))
    train(params, optimizer, 1, seed=2)
    gc.collect()
    start = _host_tensor_footprint(), _pinned_allocations()
    for cycle in range(20):
        optimizer.load_state_dict(checkpoint(optimizer))
        train(params, optimizer, 1, seed=3 + cycle)
    gc.collect()
    assert (_host_tensor_footprint(), _pinned_allocations()) == start


def test_a_fork_checkpoint_loads_with_weights_only():
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, 0.5, "group_step_adamw")
    train(params, optimizer, 2, seed=1)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert len(loaded["state"]) == len(params)
    for entry in loaded["state"].values():
        assert {"exp_avg", "exp_avg_sq", "master_param"} <= set(entry)
        assert entry["master_param"].dtype == torch.float32


def test_defaults_rebuild_an_equivalent_optimizer_and_stay_out_of_param_groups():
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, 0.5)
    rebuilt = HybridDeviceOptimizer(
        [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}], **optimizer.defaults
    )
    assert rebuilt.defaults == optimizer.defaults
    assert rebuilt.defaults["cpu_optimizer_cls"] is DeviceAdamW
    assert [len(o.param_groups[0]["params"]) for o in rebuilt.cpu_optimizers] == [
        len(o.param_groups[0]["params"]) for o in optimizer.cpu_optimizers
    ]
    for group in rebuilt.param_groups:
        assert "cpu_optimizer_cls" not in group and "offload_fraction" not in group
        assert group["lr"] == 1e-2


def test_an_upstream_style_checkpoint_with_classes_in_its_groups_loads():
    """Upstream writes its constructor options into every group; the fork drops them."""
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, 0.5)
    train(params, optimizer, 2, seed=1)
    saved = checkpoint(optimizer)
    for group in saved["param_groups"]:
        group.update({k: v for k, v in optimizer.defaults.items() if k not in group})
    optimizer.load_state_dict(saved)
    for group in optimizer.param_groups:
        assert "cpu_optimizer_cls" not in group
    train(params, optimizer, 1, seed=2)
    torch.load(io.BytesIO(_saved_bytes(optimizer)), weights_only=True)


def _saved_bytes(optimizer):
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("inner", optimizer_table.inner_params())
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_dummy_step_materialises_state_and_changes_nothing(fraction, inner):
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, fraction, inner)
    reference_params = make_params(torch.bfloat16)
    reference = make_optimizer(reference_params, fraction, inner)

    values = [p.detach().clone() for p in params]
    inner_values = [t.detach().clone() for t in optimizer.param_to_inner_param.values()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.dummy_step()

    assert_equal_params(params, values)
    assert_equal_params(list(optimizer.param_to_inner_param.values()), inner_values)
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups
    assert all(p.grad is None for p in params)
    for param in params:
        assert not optimizer.state[param]["exp_avg"].any()
    # A materialised optimizer trains exactly like a fresh one.
    train(params, optimizer, 2, seed=4)
    train(reference_params, reference, 2, seed=4)
    assert_equal_params(params, reference_params)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_state_written_into_state_from_outside_is_adopted(fraction):
    """Megatron's distributed optimizer loads ``param_state`` by assigning tensors straight
    into ``optimizer.state[p][key]`` (flat fp32 host slices); the next step must use them,
    and the sub-optimizer must hold them (in the inner tensor's shape) from then on."""
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, fraction)
    train(params, optimizer, 3, seed=1)
    saved = {
        p: {k: v.detach().cpu().float().flatten().clone() for k, v in optimizer.state[p].items()}
        for p in params
    }
    saved_params = [p.detach().clone() for p in params]
    train(params, optimizer, 2, seed=2)

    resumed_params = make_params(torch.bfloat16, seed=5)
    resumed = make_optimizer(resumed_params, fraction)
    resumed.dummy_step()
    copy_params(resumed_params, saved_params)
    for param, source in zip(resumed_params, params):
        for key, value in saved[source].items():
            resumed.state[param][key] = value.clone() if key != "step" else value.reshape(())
    train(resumed_params, resumed, 2, seed=2)
    assert_equal_params(resumed_params, params)
    for param in resumed_params:
        inner = resumed.param_to_inner_param[param]
        owner = [o for o in resumed.sub_optimizers if inner in o.state]
        assert len(owner) == 1 and owner[0].state[inner] is resumed.state[param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert resumed.state[param][key].shape == inner.shape
        assert resumed.state[param]["master_param"] is inner


def _state_snapshot(optimizer):
    return {
        id(p): {
            k: (v, v.detach().clone()) for k, v in optimizer.state[p].items() if torch.is_tensor(v)
        }
        for group in optimizer.param_groups
        for p in group["params"]
    }


def _assert_unchanged(optimizer, snapshot):
    assert _state_snapshot(optimizer).keys() == snapshot.keys()
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, (tensor, value) in snapshot[id(param)].items():
                assert optimizer.state[param][key] is tensor
                assert torch.equal(tensor, value)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda sd: sd["param_groups"].pop(), "param groups"),
        (lambda sd: sd["param_groups"][1]["params"].pop(), "param group 1"),
        (lambda sd: sd["state"][0].update(exp_avg=torch.zeros(5)), "shape"),
        (lambda sd: sd.pop("state"), "state"),
    ],
    ids=["group-count", "param-count", "shape", "missing-state"],
)
def test_a_mismatched_state_dict_raises_before_anything_changes(corrupt, message):
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, 0.5)
    train(params, optimizer, 2, seed=1)
    other_params = make_params(torch.bfloat16, seed=3)
    other = make_optimizer(other_params, 0.5)
    train(other_params, other, 3, seed=4)
    state_dict = checkpoint(other)
    corrupt(state_dict)

    snapshot = _state_snapshot(optimizer)
    groups = [dict(g) for g in optimizer.param_groups]
    with pytest.raises((ValueError, KeyError), match=message):
        optimizer.load_state_dict(state_dict)
    _assert_unchanged(optimizer, snapshot)
    assert [dict(g) for g in optimizer.param_groups] == groups


def test_placement_follows_the_tensors_when_both_classes_are_equal():
    params = make_params(torch.float32)
    optimizer = make_optimizer(params, 0.5)
    assert optimizer.cpu_optimizer_cls is optimizer.gpu_optimizer_cls
    offloaded = sum(p.numel() for p in optimizer.gpu_params_map_cpu_copy)
    total = sum(p.numel() for p in params)
    assert offloaded >= 0.5 * total and optimizer.gpu_optimizer is not None
    host_inner = {
        id(t) for o in optimizer.cpu_optimizers for g in o.param_groups for t in g["params"]
    }
    assert host_inner == {id(t) for t in optimizer.gpu_params_map_cpu_copy.values()}
    train(params, optimizer, 1, seed=1)
    # Whether a host copy is pinned is the pinning plan's call (tests of the packed copies).
    assert all(host.device.type == "cpu" for host in optimizer.gpu_params_map_cpu_copy.values())
    for param in params:
        state = optimizer.state[param]
        assert state["exp_avg"].device == optimizer.param_to_inner_param[param].device


def _options(fraction, cpu_cls, gpu_cls):
    return dict(
        offload_fraction=fraction,
        cpu_optimizer_cls=cpu_cls,
        gpu_optimizer_cls=gpu_cls,
        param_update_in_fp32=True,
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _groups(params):
    return [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]


@pytest.fixture(scope="module")
def upstream_hdo_class():
    """Upstream megatron-core 0.19.2's HybridDeviceOptimizer, loaded from its own file."""
    return upstream_modules.hybrid_optimizer_class()


def _save_then_resume(writer_cls, reader_cls, options):
    """Train with ``writer_cls``, checkpoint, go on; resume with ``reader_cls``; compare."""
    params = make_params(torch.bfloat16)
    writer = writer_cls(_groups(params), **options)
    train(params, writer, 3, seed=1)
    buffer = io.BytesIO()
    torch.save(writer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)  # upstream's groups hold classes
    saved_params = [p.detach().clone() for p in params]
    train(params, writer, 2, seed=2)

    resumed_params = make_params(torch.bfloat16, seed=7)
    reader = reader_cls(_groups(resumed_params), **options)
    copy_params(resumed_params, saved_params)
    reader.load_state_dict(saved)
    train(resumed_params, reader, 2, seed=2)
    assert_equal_params(resumed_params, params)
    return writer, reader


@requires_cuda
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_an_upstream_checkpoint_resumes_exactly_in_the_fork(upstream_hdo_class, fraction):
    # pylint: disable=redefined-outer-name
    options = _options(fraction, torch.optim.AdamW, torch.optim.AdamW)
    _save_then_resume(upstream_hdo_class, HybridDeviceOptimizer, options)


@requires_cuda
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_fork_checkpoint_loads_in_upstream(upstream_hdo_class, fraction):
    # pylint: disable=redefined-outer-name
    # Upstream places loaded state by the optimizer's class, so the two classes differ here.
    options = _options(fraction, torch.optim.AdamW, torch.optim.Adam)
    _save_then_resume(HybridDeviceOptimizer, upstream_hdo_class, options)


@requires_cuda
@pytest.mark.parametrize("stepped_before_load", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_loading_offloaded_state_allocates_nothing_on_the_gpu(dtype, stepped_before_load):
    params = [
        torch.nn.Parameter(torch.randn(1024, 1024, device="cuda").to(dtype)) for _ in range(4)
    ]
    optimizer = HybridDeviceOptimizer(
        [{"params": params}], **_options(1.0, torch.optim.AdamW, torch.optim.AdamW)
    )
    train(params, optimizer, 2, seed=1)
    saved = checkpoint(optimizer)
    resumed = HybridDeviceOptimizer(
        [{"params": params}], **_options(1.0, torch.optim.AdamW, torch.optim.AdamW)
    )
    if stepped_before_load:
        train(params, resumed, 1, seed=2)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=10000)  # pylint: disable=protected-access
    try:
        resumed.load_state_dict(saved)
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"]  # pylint: disable=protected-access
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)  # pylint: disable=protected-access
    allocations = [
        (event["size"], [f"{f['filename']}:{f['line']}" for f in event["frames"][:12]])
        for device_trace in trace
        for event in device_trace
        if event["action"] == "alloc"
    ]
    assert torch.cuda.max_memory_allocated() == before, allocations
    for param in params:
        assert all(v.device.type == "cpu" for v in resumed.state[param].values())


@requires_cuda
@pytest.mark.skipif(te_fused_adam() is None, reason="needs Transformer Engine")
@pytest.mark.parametrize("fraction", optimizer_table.DEVICE_KEPT_FRACTIONS)
def test_te_fused_adam_keeps_its_group_step_across_a_checkpoint(fraction):
    """Genuine TE FusedAdam on the in-place half counts its step in param_group["step"]."""
    options = _options(fraction, torch.optim.AdamW, te_fused_adam())
    writer, reader = _save_then_resume(HybridDeviceOptimizer, HybridDeviceOptimizer, options)
    # 3 steps, a checkpoint, 2 more. Groups stepped only on the host keep torch's
    # per-parameter step instead of a mirrored group step.
    for optimizer in (writer, reader):
        mirrored = [group.get("step") for group in optimizer.param_groups]
        assert 5 in mirrored and set(mirrored) <= {5, None}
        assert all(group["step"] == 5 for group in optimizer.gpu_optimizer.param_groups)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_steps_match_plain_adamw_on_fp32_masters(dtype, fraction):
    """The offloaded pipeline (grad widening, host step, narrowing upload through the grad
    buffer) computes exactly what AdamW on an fp32 master per parameter computes."""
    if DEVICE == "cuda" and fraction not in (0.0, 1.0):
        pytest.skip("on CUDA the two halves run different AdamW kernels; see the 0/1 cases")
    params = make_params(dtype)
    optimizer = make_optimizer(params, fraction)
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]
    masters, references = [], []
    for group in groups:
        for param in group["params"]:
            master = param.detach().to(torch.float32, copy=True)
            if fraction == 1.0:
                master = master.cpu()
            settings = {k: v for k, v in group.items() if k != "params"}
            masters.append(master)
            references.append(
                DeviceAdamW(
                    [{"params": [master], **settings}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8
                )
            )
    generator = torch.Generator().manual_seed(11)
    for _ in range(4):
        for param, master, reference in zip(params, masters, references):
            grad = torch.randn(param.shape, generator=generator).to(DEVICE, dtype)
            param.grad = grad
            master.grad = grad.to(master.device, torch.float32)
            reference.step()
        optimizer.step()
        optimizer.zero_grad()
    for param, master, reference in zip(params, masters, references):
        assert torch.equal(param.detach().cpu(), master.to(dtype).cpu())
        for key in ("exp_avg", "exp_avg_sq"):
            expected = reference.state[master][key].cpu()
            assert torch.equal(optimizer.state[param][key].cpu(), expected)


@requires_cuda
@pytest.mark.parametrize("bucket_bytes", [None, 64], ids=["default-buckets", "ring-reused"])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_steps_match_upstream_bit_for_bit(upstream_hdo_class, fraction, bucket_bytes, monkeypatch):
    # pylint: disable=redefined-outer-name
    """Same inputs, same classes: the fork's step and upstream's agree to the bit (also with
    buckets small enough that gradient slots are reused within a step)."""
    if bucket_bytes is not None:
        monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", bucket_bytes)
    options = _options(fraction, DeviceAdamW, DeviceAdamW)
    runs = []
    for hdo_class in (upstream_hdo_class, HybridDeviceOptimizer):
        params = make_params(torch.bfloat16)
        optimizer = hdo_class(_groups(params), **options)
        train(params, optimizer, 4, seed=3)
        runs.append((params, optimizer))
    (upstream_params, upstream), (params, optimizer) = runs
    assert_equal_params(params, upstream_params)
    for param, upstream_param in zip(params, upstream_params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], upstream.state[upstream_param][key])


def test_nothing_is_placed_before_first_use():
    """A wrapper that regroups first (the distributed optimizer) must not pay for the
    groups it replaces: construction builds no host copy, clone or sub-optimizer."""
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, 0.5)
    assert "param_to_inner_param" not in vars(optimizer)
    assert "cpu_optimizers" not in vars(optimizer)
    assert set(optimizer.param_to_inner_param) == set(params)  # reading it builds it


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_replace_param_groups_builds_for_the_new_groups_only(fraction):
    params = make_params(torch.bfloat16)
    shards = [torch.nn.Parameter(p.detach()[:1].clone()) for p in params]
    optimizer = make_optimizer(params, fraction)
    optimizer.replace_param_groups(
        [{"params": shards[:2], "lr": 1e-2}, {"params": shards[2:], "weight_decay": 0.1}]
    )
    assert set(optimizer.param_to_inner_param) == set(shards)
    assert all("offload_fraction" not in group for group in optimizer.param_groups)

    expected = [torch.nn.Parameter(s.detach().clone()) for s in shards]
    reference = make_optimizer(expected, fraction)
    train(shards, optimizer, 3, seed=5)
    train(expected, reference, 3, seed=5)
    assert_equal_params(shards, expected)


def test_replace_param_groups_refuses_an_optimizer_with_state():
    params = make_params(torch.float32)
    optimizer = make_optimizer(params, 0.5)
    train(params, optimizer, 1, seed=0)
    with pytest.raises(RuntimeError, match="already holds state"):
        optimizer.replace_param_groups([{"params": params}])


def test_host_optimizers_take_one_parameter_each_unless_bucketed():
    params = [torch.zeros(n) for n in (3, 4, 5, 9, 40, 2)]
    groups = [{"params": params[:5], "lr": 0.1}, {"params": params[5:], "lr": 0.2}]
    build = HybridDeviceOptimizer.build_cpu_optimizer_list

    def layout(optimizers):
        return [
            ([p.numel() for p in o.param_groups[0]["params"]], o.param_groups[0]["lr"])
            for o in optimizers
        ]

    one_each = layout(build(torch.optim.AdamW, groups))
    assert one_each == [([3], 0.1), ([4], 0.1), ([5], 0.1), ([9], 0.1), ([40], 0.1), ([2], 0.2)]
    empty = [{"params": [torch.zeros(0), torch.zeros(0), torch.zeros(3)], "lr": 0.1}]
    assert layout(build(torch.optim.AdamW, empty)) == [([0], 0.1), ([0], 0.1), ([3], 0.1)]
    # 128 bytes as staged, each copy at a 64-byte boundary: 3 and 4 elements take 64 + 16
    # bytes, 5 more would begin at 128; 40 elements (160 bytes) exceed the cap and are alone;
    # a group's last run closes with it.
    bucketed = layout(build(torch.optim.AdamW, groups, 128))
    assert bucketed == [([3, 4], 0.1), ([5, 9], 0.1), ([40], 0.1), ([2], 0.2)]


def test_full_host_buckets_stage_exactly_the_pinned_block_they_are_given(monkeypatch):
    """The host allocator pins blocks of powers of two: buckets cut at the (power-of-two) cap,
    alignment included, never need the block above it, which is what lets every host copy of
    a fine-grained MoE be pinned within upstream's pinned memory. Checked on the layout the
    ring plan stages, for an MoE-like list scaled down with the cap (experts 1/25 of it)."""
    assert hybrid_optimizer._HOST_BUCKET_BYTES & (hybrid_optimizer._HOST_BUCKET_BYTES - 1) == 0
    cap = 1 << 14
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", cap)
    params = flat_params([4, 4, 3072] + [160] * 128 + [1000, 7, 5120], torch.bfloat16)
    optimizer = make_optimizer(params, 1.0)
    buckets = [bucket for bucket in host_buckets(optimizer) if bucket.grads]
    assert sum(len(bucket.grads) for bucket in buckets) == len(params)
    shared = [bucket for bucket in buckets if len(bucket.grads) > 1]
    assert all(bucket.nbytes <= cap for bucket in shared)
    assert max(bucket.nbytes for bucket in shared) > cap - 160 * 4 - 64  # filled, not cut early
    assert len(buckets) < len(params) // 8


def test_a_sized_bucket_cap_is_an_eighth_of_the_offloaded_bytes_within_its_bounds():
    sized, mib = hybrid_optimizer.sized_bucket_bytes, 1 << 20
    assert sized(2048 * mib, 64 * mib) == 64 * mib  # an eighth above the cap: the cap
    assert sized(512 * mib, 64 * mib) == 64 * mib
    assert sized(511 * mib, 64 * mib) == 32 * mib  # the power of two below an eighth
    assert sized(128 * mib, 64 * mib) == 16 * mib
    assert sized(3 * mib, 64 * mib) == 16 * mib  # never below the least
    assert sized(3 * mib, 64 * mib, least=1 << 16) == 256 << 10
    assert sized(0, 64 * mib) == 64 * mib
    assert sized(mib, 1 << 14) == 1 << 14  # a least above the most: the most


def test_sized_host_buckets_cut_a_small_offload_finer_and_step_exactly(monkeypatch):
    """``size_host_buckets``, on by default: a small offload (a data-parallel rank's shards) is
    cut into at least eight buckets instead of filling a few up to the fixed cap; the parameters
    and the host state step exactly as with the fixed cap. Scaled down: a 64 KiB cap, 4 KiB the
    least."""
    if not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False):
        pytest.skip("the fork's buckets")
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", 1 << 16)
    monkeypatch.setattr(hybrid_optimizer, "_LEAST_SIZED_BUCKET_BYTES", 1 << 12)
    numels = [1000, 24, 2048, 777] * 10  # 150 KiB as staged in fp32: an eighth rounds to 16
    params = flat_params(numels, torch.bfloat16, seed=5)
    expected = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = make_optimizer(params, 1.0, fused=True)
    reference = make_optimizer(expected, 1.0, fused=True)
    reference.size_host_buckets = False  # read when the buckets are built, on first use
    staged = [bucket.nbytes for bucket in host_buckets(optimizer) if bucket.grads]
    assert max(staged) <= 1 << 14 < max(b.nbytes for b in host_buckets(reference))
    assert len(staged) >= 8 > len([b for b in host_buckets(reference) if b.grads])
    train(params, optimizer, 3, seed=12)
    train(expected, reference, 3, seed=12)
    assert_equal_params(params, expected)
    for param, ref in zip(params, expected):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], reference.state[ref][key])


@requires_cuda
def test_sized_buckets_give_way_to_the_fixed_cap_where_that_pins_more(monkeypatch):
    """``size_host_buckets`` keeps the fixed cap where the sized one would leave more bytes of
    host copies pageable within upstream's pinned budget (smaller buckets fill their
    power-of-two blocks less); the step is exact either way. Scaled down: a 128 KiB cap, 8 KiB
    the least; these shards size it to 32 KiB, which would leave one more copy pageable."""
    plan_pins_within_0_19_2s_budget(monkeypatch)
    if not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False):
        pytest.skip("the fork's buckets")
    fixed_cap, sized_cap = 1 << 17, 1 << 15
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", fixed_cap)
    monkeypatch.setattr(hybrid_optimizer, "_LEAST_SIZED_BUCKET_BYTES", 1 << 13)
    numels = [24095, 13, 8439, 177, 6934, 30127, 168, 9736, 81]

    def build(sized):
        hdo_class = type("HybridDeviceOptimizer", (HybridDeviceOptimizer,), {})
        hdo_class.size_host_buckets = sized
        hdo_class.host_part_bytes = 0  # every copy whole: the buckets alone differ
        params = flat_params(numels, torch.bfloat16, seed=7)
        options = dict(offload_fraction=1.0, param_update_in_fp32=True, lr=1e-2)
        optimizer = hdo_class(
            [{"params": params}],
            cpu_optimizer_cls=DeviceAdamW,
            gpu_optimizer_cls=DeviceAdamW,
            **options,
        )
        return params, optimizer

    def pageable_bytes(optimizer):
        copies = {}
        for bucket in host_buckets(optimizer):
            for host, pinned in zip(bucket.hosts, bucket.pinned):
                copies[id(host)] = 0 if pinned else host.numel() * host.element_size()
        return sum(copies.values())

    chosen, fixed = build(True), build(False)
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", sized_cap)
    only_sized = build(False)  # the sized cap's buckets, built as a fixed cap
    only_sized[1]._init_sub_optimizers()  # pylint: disable=protected-access
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", fixed_cap)
    chosen[1]._init_sub_optimizers()  # pylint: disable=protected-access
    assert chosen[1]._host_bucket_bytes() == sized_cap
    for params, optimizer in (chosen, fixed, only_sized):
        train(params, optimizer, 3, seed=11)
    assert pageable_bytes(chosen[1]) == pageable_bytes(fixed[1]) < pageable_bytes(only_sized[1])
    assert [b.nbytes for b in host_buckets(chosen[1])] == [b.nbytes for b in host_buckets(fixed[1])]
    for params in (chosen[0], only_sized[0]):
        assert_equal_params(params, fixed[0])


def test_many_small_parameters_share_host_optimizers_and_step_exactly():
    generator = torch.Generator().manual_seed(3)
    params = [
        torch.nn.Parameter(torch.randn(64, generator=generator).to(DEVICE, torch.bfloat16))
        for _ in range(40)
    ]
    expected = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = make_optimizer(params, 1.0)
    assert len(optimizer.cpu_optimizers) == 2  # one per group: each far below the cap
    reference = make_optimizer(expected, 1.0, overlap_cpu_optimizer_d2h_h2d=False)
    train(params, optimizer, 3, seed=9)
    train(expected, reference, 3, seed=9)
    assert_equal_params(params, expected)


# ---------------------------------------------------------------- the gradient ring
# With the bucket size lowered to the parameters' size, every parameter is a bucket of its
# own, so a handful of small parameters exercises slot reuse, slot sizing and the order of
# downloads and host steps (on the host the same code runs, synchronously).


def flat_params(numels, dtype, seed=0):
    """1-D parameters of the given sizes, so each can be a bucket of its own."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(n, generator=generator).to(DEVICE, dtype)) for n in numels
    ]


def bucket_grads(optimizer):
    """Per host sub-optimizer: (storage pointer, byte offset, bytes) of each staged gradient."""
    return [
        [
            (
                grad.untyped_storage().data_ptr(),
                grad.storage_offset() * grad.element_size(),
                grad.numel() * grad.element_size(),
            )
            for grad in (
                optimizer.cpu_copy_map_grad[host] for host in sub.param_groups[0]["params"]
            )
        ]
        for sub in optimizer.cpu_optimizers
    ]


def assert_packed_ring(optimizer):
    """Each bucket's gradients are consecutive views into one slot, every slot holds the
    largest of its buckets, consecutive buckets rotate through the slots, and the ring is
    smaller than a buffer per parameter. Returns the number of slots."""
    layout = bucket_grads(optimizer)
    storages = {}
    for views in layout:
        assert len({ptr for ptr, _, _ in views}) == 1, "a bucket spans slots"
        end = 0
        for _, offset, nbytes in views:
            assert offset >= end
            end = offset + nbytes
        storages.setdefault(views[0][0], set()).add(end)
    grads = list(optimizer.cpu_copy_map_grad.values())
    slot_bytes = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
    for ptr, ends in storages.items():
        assert slot_bytes[ptr] == max(ends), "a slot is not sized to its largest bucket"
    slots = len(storages)
    order = [views[0][0] for views in layout]
    assert order == [order[i % slots] for i in range(len(order))], "slots are not reused in turn"
    ring = sum(
        {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}.values()
    )
    assert ring <= sum(g.numel() * g.element_size() for g in grads)
    return slots


def train_masters_reference(params, groups_of, steps, seed, has_grad=lambda step, index: True):
    """Plain AdamW on an fp32 master per parameter, drawing the gradients ``train`` draws."""
    masters, references = [], []
    for index, param in enumerate(params):
        master = param.detach().to("cpu", torch.float32, copy=True)
        masters.append(master)
        references.append(
            DeviceAdamW(
                [{"params": [master], **groups_of(index)}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8
            )
        )
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for index, (param, master) in enumerate(zip(params, masters)):
            grad = torch.randn(param.shape, generator=generator).to(param.dtype).float()
            master.grad = grad if has_grad(step, index) else None
        for reference in references:
            reference.step()
    return masters, references


def train_drawn(params, optimizer, steps, seed, has_grad=lambda step, index: True, check=None):
    """``train``, with some gradients left out and ``check(optimizer)`` after every step."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for index, param in enumerate(params):
            grad = torch.randn(param.shape, generator=generator).to(DEVICE, param.dtype)
            param.grad = grad if has_grad(step, index) else None
        optimizer.step()
        optimizer.zero_grad()
        if check is not None:
            check(optimizer)


def assert_matches_reference(optimizer, params, masters, references):
    """Parameters are their masters narrowed, moments equal the reference's, bit for bit."""
    for param, master, reference in zip(params, masters, references):
        assert torch.equal(param.detach().cpu(), master.to(param.dtype))
        for key in ("exp_avg", "exp_avg_sq"):
            expected = reference.state[master].get(key)
            actual = optimizer.state[param].get(key)
            assert (expected is None) == (actual is None), key
            if expected is not None:
                assert torch.equal(actual.cpu(), expected)


def _second_group_settings(index):
    return {"weight_decay": 0.1} if index >= 2 else {}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_more_buckets_than_slots_reuse_the_ring_and_step_exactly(dtype, monkeypatch):
    """Eight buckets share a few slots in turn; a slot refilled before its bucket has stepped
    would change the result."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", 64 * 4)
    params = flat_params([64] * 8, dtype)
    masters, references = train_masters_reference(params, _second_group_settings, 4, seed=5)
    optimizer = make_optimizer(params, 1.0)
    layouts = []
    train_drawn(params, optimizer, 4, seed=5, check=lambda o: layouts.append(bucket_grads(o)))
    assert len(layouts[0]) == 8
    assert 1 < assert_packed_ring(optimizer) < 8
    assert all(layout == layouts[0] for layout in layouts)  # nothing is rebuilt per step
    assert_matches_reference(optimizer, params, masters, references)


@pytest.mark.parametrize(
    "numels", [[64, 64, 256, 64, 64, 64], [1024, 64, 64, 64]], ids=["one-larger", "dominant"]
)
def test_each_slot_holds_the_largest_of_its_buckets(numels, monkeypatch):
    """Slots are sized by the buckets staged in them: the largest bucket takes one large slot
    and the others stay small, so a dominant parameter (an embedding) does not multiply the
    ring; the ring never exceeds one gradient buffer per parameter."""
    plan_pins_within_0_19_2s_budget(monkeypatch)
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", 64 * 4)
    params = flat_params(numels, torch.bfloat16)
    masters, references = train_masters_reference(params, _second_group_settings, 3, seed=8)
    optimizer = make_optimizer(params, 1.0)
    train(params, optimizer, 3, seed=8)
    slots = assert_packed_ring(optimizer)  # each slot exactly its largest bucket
    sizes = {
        g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
        for g in optimizer.cpu_copy_map_grad.values()
    }
    largest = max(numels) * 4  # fp32 gradients of the largest bucket
    # Pinned (on a GPU), two slots: within upstream's budget a third would leave one more copy
    # pageable. Unpinned slots cost no budget: three.
    assert slots == (2 if ring_plan(optimizer).pin_slots else 3)
    assert sorted(sizes.values()).count(largest) == 1
    assert sum(sizes.values()) < slots * largest
    assert_matches_reference(optimizer, params, masters, references)


@pytest.mark.parametrize("overlap", [True, False], ids=["ring", "one-slot"])
def test_parameters_without_gradients_skip_their_step_in_the_ring(overlap, monkeypatch):
    """A parameter without a gradient is neither stepped nor uploaded, and its stale slot
    bytes reach no other parameter, whether its bucket has other gradients or none."""
    plan_pins_within_0_19_2s_budget(monkeypatch)
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", 32 * 4)
    numels = [32, 48, 32, 32, 16, 16, 32]

    def has_grad(step, index):
        # Parameter 1 (a bucket of its own) never gets one, parameter 4 every other step,
        # parameter 5 (sharing a bucket with 4) only from the second step on.
        return {1: False, 4: step % 2 == 0, 5: step > 0}.get(index, True)

    params = flat_params(numels, torch.bfloat16)
    masters, references = train_masters_reference(
        params, _second_group_settings, 4, seed=2, has_grad=has_grad
    )
    optimizer = make_optimizer(params, 1.0, overlap_cpu_optimizer_d2h_h2d=overlap)
    initial = params[1].detach().clone()
    train_drawn(params, optimizer, 4, seed=2, has_grad=has_grad)
    assert torch.equal(params[1].detach(), initial)
    assert "exp_avg" not in optimizer.state[params[1]]
    assert_matches_reference(optimizer, params, masters, references)
    # Without overlap the same buckets share a single slot: each download waits for the
    # previous bucket's step. With pinned slots the plan keeps two where that pins more copies.
    assert len(optimizer.cpu_optimizers) == 6
    ring = 2 if ring_plan(optimizer).pin_slots else 3
    assert assert_packed_ring(optimizer) == (ring if overlap else 1)


@requires_cuda
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("in_fp32", [True, False])
@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_the_fork_pins_no_more_than_upstream(
    upstream_hdo_class, fraction, in_fp32, overlap, monkeypatch
):
    """After a step, the pinned storage the fork's tensors use (ring slots, then host copies
    in order) is at most what upstream 0.19.2's tensors use for the same run, and is exactly
    the planned amount; a build alone (as a checkpoint load triggers) pins nothing."""
    # The overlay package is absent from a vendored tree; so is upstream's HDO to compare with.
    memory = pytest.importorskip("megatron_optimizer_fork.memory")
    numel = 1 << 18
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", numel * 4)
    figures = {}
    for name, cls in (("upstream", upstream_hdo_class), ("fork", HybridDeviceOptimizer)):
        params = flat_params([numel] * 8, torch.bfloat16)
        memory.release_cached_pinned_memory()
        before = memory.pinned_bytes_in_use()
        optimizer = make_optimizer(
            params, fraction, param_update_in_fp32=in_fp32, overlap_cpu_optimizer_d2h_h2d=overlap
        )
        if name == "fork":
            optimizer.dummy_step()
            assert memory.pinned_bytes_in_use() == before
        train(params, optimizer, 1, seed=1)
        figures[name] = memory.pinned_bytes_in_use() - before
        if name == "fork":
            copies = list(optimizer.gpu_params_map_cpu_copy.values())
            pinned = [copy.is_pinned() for copy in copies]
            assert pinned == sorted(pinned, reverse=True)  # the last copies stay pageable
            slots = {
                g.untyped_storage().data_ptr(): g for g in optimizer.cpu_copy_map_grad.values()
            }
            assert all(g.is_pinned() for g in slots.values())
            ring = sum(g.untyped_storage().nbytes() for g in slots.values())
            masters = sum(c.numel() * c.element_size() for c, pin in zip(copies, pinned) if pin)
            assert figures["fork"] == ring + masters
        del optimizer, params
    assert 0 < figures["fork"] <= figures["upstream"], figures


@requires_cuda
@pytest.mark.parametrize("overlap", [True, False], ids=["ring", "one-slot"])
def test_a_slot_stages_only_the_pageable_uploads_of_its_last_bucket(overlap, monkeypatch):
    """The upload narrows on the device: after a step, each slot still holds the widened
    gradients of the last bucket that used it, except where that bucket's host copy was left
    pageable: it goes up through the free slot, which then holds the stepped copy. Results
    are those of the straightforward path either way."""
    plan_pins_within_0_19_2s_budget(monkeypatch)
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", 64 * 4)
    params = flat_params([64] * 8, torch.bfloat16)
    masters, references = train_masters_reference(params, _second_group_settings, 1, seed=4)
    optimizer = make_optimizer(params, 1.0, overlap_cpu_optimizer_d2h_h2d=overlap)
    grads = []
    generator = torch.Generator().manual_seed(4)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(DEVICE, param.dtype)
        grads.append(param.grad.float().cpu())
    optimizer.step()
    last_user = {}
    for param, grad in zip(params, grads):
        host = optimizer.gpu_params_map_cpu_copy[param]
        staged = optimizer.cpu_copy_map_grad[host]
        last_user[staged.untyped_storage().data_ptr()] = (staged, grad, host)
    # Upstream's pinned budget (one fp32 gradient buffer per parameter) cannot hold the ring
    # and every copy, so the last copies are pageable.
    assert sum(not host.is_pinned() for _, _, host in last_user.values()) > 0
    for staged, grad, host in last_user.values():
        assert torch.equal(staged, grad if host.is_pinned() else host)
    assert_matches_reference(optimizer, params, masters, references)


@requires_cuda
def test_pageable_copies_go_up_through_their_slot_before_it_is_reused(monkeypatch):
    """A large first bucket widens the ring, so upstream's pinned budget leaves copies
    pageable whose slot a later bucket reuses. Each still goes up through its pinned
    slot (no upload from pageable memory, which blocks the host), and the later download into
    that slot waits for the upload: the results are those of the straightforward path."""
    plan_pins_within_0_19_2s_budget(monkeypatch)
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", 64 * 4)
    params = flat_params([256] + [64] * 7, torch.bfloat16)
    masters, references = train_masters_reference(params, _second_group_settings, 3, seed=6)
    optimizer = make_optimizer(params, 1.0)
    copies = set()  # the copies the optimizer's steps made (the test's own go up pageable)
    step = optimizer.step

    def profiled_step():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            step()
            torch.cuda.synchronize()
        copies.update(event.name for event in profile.events() if "Memcpy" in event.name)

    optimizer.step = profiled_step
    train_drawn(params, optimizer, 3, seed=6)
    followed = [
        bucket
        for bucket in host_buckets(optimizer)
        if bucket.follower is not None and not bucket.hosts[0].is_pinned()
    ]
    assert followed, "no pageable copy has a bucket after it in its slot"
    assert "Memcpy HtoD (Pinned -> Device)" in copies
    assert "Memcpy HtoD (Pageable -> Device)" not in copies, copies
    assert_matches_reference(optimizer, params, masters, references)


@pytest.mark.parametrize("fraction", [0.5, 0.0])
def test_fp32_params_with_only_a_decoupled_grad_are_stepped_in_place_too(fraction):
    """The precision-aware distributed optimizer hands fp32 shards their gradient as
    ``decoupled_grad`` alone. Those stepped in place get the same update as with ``grad``
    (a plain AdamW on fp32 masters), state included, and no ``grad`` is left behind."""
    params = make_params(torch.float32)
    optimizer = make_optimizer(params, fraction)
    reference_params = make_params(torch.float32)
    reference = make_optimizer(reference_params, fraction)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        for param, twin in zip(params, reference_params):
            grad = torch.randn(param.shape, generator=generator).to(DEVICE)
            param.decoupled_grad = grad
            twin.grad = grad.clone()
        optimizer.step()
        reference.step()
        assert all(param.grad is None for param in params)
        optimizer.zero_grad()
        reference.zero_grad()
    assert any(inner is param for param, inner in optimizer.param_to_inner_param.items())
    for param, twin in zip(params, reference_params):
        assert torch.equal(param, twin)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[param][key], reference.state[twin][key]), key


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_update_fp32_param_by_new_param_refreshes_every_inner_copy(fraction):
    """After the parameters change outside the optimizer (the distributed optimizer copying
    loaded model weights in), every host copy and fp32 clone holds the new values, so the next
    step starts from them."""
    params = make_params(torch.bfloat16)
    optimizer = make_optimizer(params, fraction)
    train(params, optimizer, 1, seed=1)
    with torch.no_grad():
        for param in params:
            param.add_(1.0)
    optimizer.update_fp32_param_by_new_param()
    copies = [(p, inner) for p, inner in optimizer.param_to_inner_param.items() if inner is not p]
    assert copies
    for param, inner in copies:
        assert torch.equal(inner, param.detach().to(inner.device, inner.dtype))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_decoupled_grads_too(set_to_none):
    """Megatron's zero_grad reaches the inner optimizer; a ``decoupled_grad`` left over would
    be stepped again next time as if it were new."""
    params = make_params(torch.float32)
    optimizer = make_optimizer(params, 0.5)
    for param in params:
        param.grad = torch.ones_like(param)
        param.decoupled_grad = torch.ones_like(param)
    optimizer.zero_grad(set_to_none=set_to_none)
    for param in params:
        for grad in (param.grad, param.decoupled_grad):
            if set_to_none:
                assert grad is None
            else:
                assert torch.equal(grad, torch.zeros_like(param))


def test_upstream_pinned_bytes_counts_grad_buffers_and_unwidened_copies():
    """0.19.2 keeps a gradient buffer per offloaded parameter in the host copy's dtype and
    its pinned parameter copy only when that copy is the host copy (no fp32 update)."""
    bf16 = torch.zeros(10, dtype=torch.bfloat16)
    widened = (torch.zeros(10), bf16)
    kept = (torch.zeros(10, dtype=torch.bfloat16), bf16)
    assert hybrid_optimizer.upstream_pinned_bytes([widened, widened], pin_grads=True) == 80
    assert hybrid_optimizer.upstream_pinned_bytes([widened], pin_grads=False) == 0
    assert hybrid_optimizer.upstream_pinned_bytes([kept], pin_grads=True) == 40
    assert hybrid_optimizer.upstream_pinned_bytes([kept], pin_grads=False) == 20


def test_pinned_memory_is_counted_in_the_blocks_the_host_allocator_holds():
    """The caching host allocator holds a power of two for each pinned allocation, upstream's
    as well as the fork's: the plan can count both sides that way, so what the process holds
    pinned, not only what its tensors use, stays within upstream's."""
    block = hybrid_optimizer.pinned_block_bytes
    assert [block(n) for n in (0, 1, 3, 4, 5, 1000)] == [0, 1, 4, 4, 8, 1024]
    bf16 = torch.zeros(10, dtype=torch.bfloat16)
    widened = (torch.zeros(10), bf16)  # 40-byte fp32 host copies: 64-byte blocks
    kept = (torch.zeros(10, dtype=torch.bfloat16), bf16)  # 20 bytes: 32-byte blocks
    assert hybrid_optimizer.upstream_pinned_bytes([widened] * 2, True, held=True) == 128
    assert hybrid_optimizer.upstream_pinned_bytes([kept], True, held=True) == 64
    # Counted in blocks, two slots (8 + 4) leave room for one 3-byte copy (a 4-byte block);
    # counted in bytes (8 + 3 + 3 <= 16) both would be pinned and hold 20 bytes.
    plan = hybrid_optimizer.plan_pinned_host_memory
    assert plan([5, 3], [3, 3], 16, 2, True, block) == (2, [True, False])
    assert plan([5, 3], [3, 3], 16, 2, True) == (2, [True, True])


@pytest.mark.parametrize(
    "buckets,masters,budget,max_slots,expected",
    [
        # 16 equal fp32 masters, a bucket each, upstream's 4 bytes per element: a third slot
        # would push a third copy out of the budget, so the ring keeps two.
        ([4] * 16, [4] * 16, 64, 3, (2, [True] * 14 + [False] * 2)),
        # Three slots where dropping one pins nothing more (the freed bytes fit no copy).
        ([4] * 4, [8] * 4, 30, 3, (3, [True, True, False, False])),
        # Two slots where they pin one copy more than three.
        ([3] * 6, [4] * 4, 18, 3, (2, [True, True, True, False])),
        # Without overlap one slot: one copy stays pageable.
        ([4] * 16, [4] * 16, 64, 1, (1, [True] * 15 + [False])),
        # Unpinned slots cost no budget.
        ([4] * 4, [4] * 4, 16, 3, (3, [True] * 4)),
        # A slot larger than the budget still gets one; nothing else is pinned.
        ([40], [8, 8], 20, 3, (1, [False, False])),
        # Each slot is as large as its own largest bucket: a dominant bucket does not make
        # every slot as large (12 + 2 + 2 bytes of ring, not 36).
        ([12, 2, 2], [4, 4, 4], 17, 3, (3, [False] * 3)),
        ([12, 2, 2, 2], [3] * 4, 22, 3, (3, [True, True, False, False])),
        # Slots shrink to fit the budget before any copy is pinned.
        ([10, 10, 10], [10, 10, 10], 25, 3, (2, [False] * 3)),
        ([], [4, 4], 8, 3, (0, [False, False])),
    ],
)
def test_the_pinning_plan_puts_the_ring_first_and_stays_within_budget(
    buckets, masters, budget, max_slots, expected
):
    pin_slots = budget != 16
    slots, pinned = hybrid_optimizer.plan_pinned_host_memory(
        buckets, masters, budget, max_slots, pin_slots
    )
    assert (slots, pinned) == expected
    ring = sum(hybrid_optimizer.slot_sizes(buckets, slots)) if slots else 0
    used = (ring if pin_slots else 0) + sum(m for m, p in zip(masters, pinned) if p)
    assert used <= budget or slots == 1


class ConvNet(torch.nn.Module):
    """Convolutions, pooling and linear layers: weights and biases of many shapes."""

    def __init__(self, width=120):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 6, 5),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(6, 16, 5),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
        )
        self.head = torch.nn.Sequential(
            torch.nn.Linear(16 * 5 * 5, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 84),
            torch.nn.ReLU(),
            torch.nn.Linear(84, 10),
        )

    def forward(self, x):  # pylint: disable=missing-function-docstring
        return self.head(self.features(x))


def _grouped(params, with_groups):
    """Megatron-style groups (with keys the optimizers ignore), or the plain list."""
    if not with_groups:
        return params
    half = len(params) // 2
    return [
        {"params": params[:half], "wd_mult": 1.0, "lr_mult": 1e-4},
        {"params": params[half:], "wd_mult": 0.0, "lr_mult": 2e-4, "weight_decay": 0.01},
    ]


@pytest.mark.parametrize("n_steps", [1, 10])
@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("with_groups", [False, True], ids=["one_group", "two_groups"])
def test_a_network_trains_as_its_optimizer_class_would_where_each_parameter_steps(
    with_groups, optimizer_cls, fraction, overlap, n_steps
):
    """Each parameter follows the optimizer class it is given to, run where the HDO steps it
    (its host copy or in place), bit for bit; state appears with the first step, beside the
    tensor it belongs to."""
    torch.manual_seed(42)
    net = ConvNet().to(DEVICE)
    params = list(net.parameters())
    optimizer = HybridDeviceOptimizer(
        _grouped(params, with_groups),
        offload_fraction=fraction,
        cpu_optimizer_cls=optimizer_cls,
        gpu_optimizer_cls=optimizer_cls,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        lr=1e-3,
    )
    assert not optimizer.state_dict()["state"]
    settings = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            settings[param] = {k: v for k, v in group.items() if k != "params"}
    twins = {}
    for param in params:
        where = optimizer.param_to_inner_param[param].device
        twin = param.detach().to(where, copy=True)
        twins[param] = (twin, optimizer_cls([{"params": [twin], **settings[param]}]))
    generator = torch.Generator().manual_seed(7)
    for _ in range(n_steps):
        batch = torch.randn(2, 3, 32, 32, generator=generator).to(DEVICE)
        net(batch).sum().backward()
        for param, (twin, reference) in twins.items():
            twin.grad = param.grad.to(twin.device)
            reference.step()
        optimizer.step()
        optimizer.zero_grad()
    for param, (twin, reference) in twins.items():
        assert torch.equal(param.detach().cpu(), twin.cpu())
        inner = optimizer.param_to_inner_param[param]
        for key, value in reference.state[twin].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                mine = optimizer.state[param][key]
                assert mine.device == inner.device and torch.equal(mine.cpu(), value.cpu()), key
    if optimizer_cls is torch.optim.Adam:
        assert len(optimizer.state_dict()["state"]) == len(params)


@requires_cuda
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
def test_back_to_back_steps_of_a_large_network_keep_copies_in_order(optimizer_cls, fraction):
    """Ten steps in a row, no reference run in between: each step's downloads and uploads of a
    network with layers of millions of elements (buckets of their own, slots reused) finish
    before the next step reads or writes them."""
    torch.manual_seed(42)
    net = ConvNet(width=16384).cuda()
    hybrid = HybridDeviceOptimizer(
        list(net.parameters()),
        offload_fraction=fraction,
        cpu_optimizer_cls=optimizer_cls,
        gpu_optimizer_cls=optimizer_cls,
        overlap_cpu_optimizer_d2h_h2d=True,
        lr=1e-3,
    )
    # The reference steps each parameter where the HDO does, so the two agree bit for bit.
    placed = [
        p.detach().to(hybrid.param_to_inner_param[p].device, copy=True) for p in net.parameters()
    ]
    reference = [optimizer_cls([t], lr=1e-3) for t in placed]
    batches = [torch.randn(2, 3, 32, 32, device="cuda") for _ in range(10)]
    grads = []
    for batch in batches:
        net(batch).sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        hybrid.step()
        hybrid.zero_grad()
    for step_grads in grads:
        for tensor, grad, ref in zip(placed, step_grads, reference):
            tensor.grad = grad.to(tensor.device)
            ref.step()
    for param, tensor in zip(net.parameters(), placed):
        assert torch.equal(param.detach().cpu(), tensor.cpu())


def _mixed_precision_params(seed):
    """bf16 parameters beside ones kept in fp32 (Megatron's ``mark_keep_in_fp32`` where the
    tree has it): the fp32 ones get no fp32 copy under ``param_update_in_fp32``."""
    try:
        from megatron.core.transformer.module import (  # pylint: disable=import-outside-toplevel
            mark_keep_in_fp32,
        )
    except ImportError:
        mark_keep_in_fp32 = None
    params = make_params(torch.bfloat16, seed=seed)
    kept = make_params(torch.float32, seed=seed + 100)[:3]
    for param in kept:
        if mark_keep_in_fp32 is not None:
            mark_keep_in_fp32(param)
    return params[:2] + kept + params[2:]


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_native_fp32_parameters_beside_bf16_ones_resume_exactly(fraction):
    params = _mixed_precision_params(seed=0)
    optimizer = make_optimizer(params, fraction)
    assert any(p.dtype == torch.float32 for p in params)
    assert all(p not in optimizer.param_to_fp32_param for p in params if p.dtype == torch.float32)
    train(params, optimizer, 3, seed=1)
    saved = checkpoint(optimizer)
    saved_params = [p.detach().clone() for p in params]
    train(params, optimizer, 2, seed=2)

    resumed_params = _mixed_precision_params(seed=5)
    resumed = make_optimizer(resumed_params, fraction)
    copy_params(resumed_params, saved_params)
    resumed.load_state_dict(saved)
    resumed._sync_hdo_state_to_sub_optimizers()  # pylint: disable=protected-access
    train(resumed_params, resumed, 2, seed=2)
    assert_equal_params(resumed_params, params)
