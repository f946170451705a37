# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HybridDeviceOptimizer's packed buckets step exactly as one copy per parameter would.

A bucket of several small parameters moves as one block each way (its host copies are views
into one flat block; on CUDA its gradients are gathered into a device staging buffer). Each
test runs the packed optimizer beside the straightforward one (every parameter a bucket of
its own, copied tensor by tensor) on the same inputs and compares parameters and state with
``torch.equal``: a gradient or a parameter copied to the wrong place, a step skipped or taken
twice, a stale block uploaded, any of them shows. On a host without CUDA the same code runs on
host copies; with CUDA the copies cross the bus through pinned slots and side streams.
"""

import itertools

import pytest
import torch

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer
from megatron.core.optimizer.cpu_offloading import hybrid_optimizer_buckets as buckets
from megatron.core.optimizer.cpu_offloading import hybrid_optimizer_in_place as in_place
from megatron.core.optimizer.cpu_offloading import hybrid_optimizer_plan as plan
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

train_drawn = optimizer_table.sibling("test_optimizer_cpu_offloading").train_drawn
host_buckets = optimizer_table.sibling("test_optimizer_cpu_offloading").host_buckets
upstream_modules = optimizer_table.sibling("upstream_modules")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The buckets and their blocks are the fork's design; upstream has neither to compare.
pytestmark = pytest.mark.skipif(
    not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False), reason="the fork's buckets"
)

# Odd sizes and shapes, two dtypes in one bucket, a large parameter after small ones (it
# closes the run before it and is a bucket of its own), groups with their own settings.
LAYOUT = [
    [((3,), torch.bfloat16), ((17, 5), torch.float32), ((1,), torch.bfloat16)],
    [((129,), torch.bfloat16), ((7, 3), torch.float32), ((4096,), torch.bfloat16)],
    [((2,), torch.bfloat16), ((64,), torch.bfloat16), ((33,), torch.float32)],
]
BUCKET_BYTES = 1024


def has_grad(step, index):
    """Some gradients missing: one parameter every other step, another only at first."""
    return {1: step % 2 == 0, 7: step == 0}.get(index, True)


def make_params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(DEVICE, dtype))
        for group in LAYOUT
        for shape, dtype in group
    ]


def make_optimizer(params, fraction, hdo_class=HybridDeviceOptimizer, **options):
    sizes = [len(group) for group in LAYOUT]
    groups = [
        {"params": params[: sizes[0]]},
        {"params": params[sizes[0] : sizes[0] + sizes[1]], "weight_decay": 0.1},
        {"params": params[sizes[0] + sizes[1] :], "lr": 3e-3},
    ]
    fused = True if DEVICE == "cuda" else None
    settings = dict(
        offload_fraction=fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=fused,
    )
    settings.update(options)
    if settings["fused"] is None:
        del settings["fused"]
    return hdo_class(groups, **settings)


def every_grad(step, index):  # pylint: disable=unused-argument
    """Every parameter has a gradient at every step."""
    return True


def train(params, optimizer, steps, seed, between=None, grads=has_grad):
    """``train_drawn`` with the gradient pattern ``grads`` (by default this file's, with
    gradients missing); ``between(optimizer, step)`` runs after every step."""
    counter = itertools.count()
    check = None if between is None else lambda opt: between(opt, next(counter))
    train_drawn(params, optimizer, steps, seed, has_grad=grads, check=check)


def run(fraction, bucket_bytes, monkeypatch, steps=4, between=None, grads=has_grad, **options):
    """Params and optimizer after ``steps`` steps with host buckets of ``bucket_bytes``."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", bucket_bytes)
    params = make_params()
    optimizer = make_optimizer(params, fraction, **options)
    train(params, optimizer, steps, seed=7, between=between, grads=grads)
    return params, optimizer


def assert_same(actual, expected):
    (params, optimizer), (reference_params, reference) = actual, expected
    for index, (param, ref) in enumerate(zip(params, reference_params)):
        assert torch.equal(param, ref), f"parameter {index}"
        state, ref_state = optimizer.state[param], reference.state[ref]
        assert sorted(state) == sorted(ref_state), f"parameter {index}"
        for key, value in ref_state.items():
            if torch.is_tensor(value):
                assert torch.equal(state[key].cpu(), value.cpu()), f"parameter {index} {key}"


def packed_host_buckets(optimizer):
    """The HDO's packed host buckets in step order, built on first use."""
    return [b for b in host_buckets(optimizer) if isinstance(b, buckets.PackedCopies)]


def packed_buckets(optimizer):
    """The packed buckets, each checked to be one block: every host copy a view into it."""
    packed = packed_host_buckets(optimizer)
    for bucket in packed:
        block = bucket.master.untyped_storage().data_ptr()
        assert all(h.untyped_storage().data_ptr() == block for h in bucket.hosts)
    return packed


@pytest.mark.parametrize("in_fp32", [True, False], ids=["fp32-masters", "as-is"])
@pytest.mark.parametrize("overlap", [True, False], ids=["ring", "one-slot"])
@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_packed_buckets_step_as_one_copy_per_parameter(fraction, overlap, in_fp32, monkeypatch):
    options = dict(param_update_in_fp32=in_fp32, overlap_cpu_optimizer_d2h_h2d=overlap)
    packed = run(fraction, BUCKET_BYTES, monkeypatch, **options)
    assert len(packed_buckets(packed[1])) == (2 if fraction == 0.5 else 3)
    one_each = run(fraction, 0, monkeypatch, **options)
    assert not packed_buckets(one_each[1])
    assert_same(packed, one_each)


def test_a_host_copy_re_pointed_by_a_client_is_packed_again(monkeypatch):
    """A client that replaces a host copy's ``.data`` between steps (keeping its values) must
    not leave the packed upload sending the block's stale bytes."""

    def re_point(optimizer, step):
        if step == 1:
            for bucket in packed_buckets(optimizer):
                for host in bucket.hosts:
                    host.data = host.detach().clone()

    packed = run(1.0, BUCKET_BYTES, monkeypatch, between=re_point)
    assert packed_buckets(packed[1])  # the block was rebuilt around the copies
    assert_same(packed, run(1.0, 0, monkeypatch))


def test_host_copies_keep_their_objects_and_values_when_packed(monkeypatch):
    """Packing happens on the first step and keeps every map's tensor objects; a copy's
    master values written before it (a checkpoint load) are the ones that are stepped."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", BUCKET_BYTES)
    params = make_params()
    optimizer = make_optimizer(params, 1.0, param_update_in_fp32=True)
    hosts = dict(optimizer.gpu_params_map_cpu_copy)
    packed = packed_host_buckets(optimizer)
    assert packed and all(bucket.master is None for bucket in packed)
    train(params, optimizer, 1, seed=1)
    assert all(optimizer.gpu_params_map_cpu_copy[p] is h for p, h in hosts.items())
    assert all(optimizer.state[p]["master_param"] is h for p, h in hosts.items())
    for param, host in hosts.items():
        assert torch.equal(param.detach().cpu(), host.to(param.dtype))


def test_widened_gradients_are_the_gradients_cast_one_by_one():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=generator).to(DEVICE, torch.bfloat16) for s in (5, (3, 2))]
    grads.insert(1, None)
    widened = in_place.widened(grads)
    assert widened[1] is None
    for grad, wide in zip(grads, widened):
        if grad is not None:
            assert wide.dtype == torch.float32 and torch.equal(wide, grad.float())


@requires_cuda
@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_packed_buckets_match_upstream_bit_for_bit(fraction, monkeypatch):
    """The same inputs through upstream 0.19.2's HDO (one optimizer per parameter). Every
    parameter has its gradient: upstream steps a parameter without one on its last gradient
    (which the fork does not), so missing gradients are compared with the fork alone."""
    upstream_class = upstream_modules.hybrid_optimizer_class()
    packed = run(fraction, BUCKET_BYTES, monkeypatch, grads=every_grad, param_update_in_fp32=True)
    assert packed_buckets(packed[1])
    params = make_params()
    reference = make_optimizer(params, fraction, upstream_class, param_update_in_fp32=True)
    train(params, reference, 4, seed=7, grads=every_grad)
    for index, (param, ref) in enumerate(zip(packed[0], params)):
        assert torch.equal(param, ref), f"parameter {index}"


@requires_cuda
def test_a_step_on_the_callers_own_stream_leaves_that_stream_current(monkeypatch):
    """A step queued from a stream of the caller's own (a training loop that runs its
    optimizer on a side stream) waits for that stream's gradients and leaves it current: the
    copies' switches to their streams come back to the stream the step began on, not to the
    default one."""
    side = torch.cuda.Stream()

    def still_on_side(optimizer, step):  # pylint: disable=unused-argument
        assert torch.cuda.current_stream() == side

    with torch.cuda.stream(side):
        on_side = run(1.0, BUCKET_BYTES, monkeypatch, between=still_on_side, grads=every_grad)
    torch.cuda.synchronize()
    assert packed_buckets(on_side[1])
    assert_same(on_side, run(1.0, BUCKET_BYTES, monkeypatch, grads=every_grad))


def _steps_on_second_device(late: bool, steps: int = 3):
    """Params on cuda:1 after ``steps`` steps called with cuda:0 current; each step's
    gradients are written on cuda:1's current stream, behind a ~50 ms sleep where ``late``.
    Also whether cuda:0, and cuda:1's stream of before, were current after every step."""
    with torch.cuda.device(1):
        params = [torch.nn.Parameter(p.detach().to("cuda:1")) for p in make_params()]
        optimizer = make_optimizer(params, 1.0, param_update_in_fp32=True)
    generator = torch.Generator().manual_seed(3)
    stayed, stream_of_1 = [], torch.cuda.current_stream(1)
    for _ in range(steps):
        drawn = [torch.randn(p.shape, generator=generator).to(p.device, p.dtype) for p in params]
        with torch.cuda.device(1):
            if late:
                torch.cuda._sleep(100_000_000)  # pylint: disable=protected-access
            for param, grad in zip(params, drawn):
                param.grad = grad.clone()  # queued behind the sleep
        # The race is set up: the gradients are still being written when the step begins.
        assert not late or not torch.cuda.current_stream(1).query()
        optimizer.step()
        stayed.append(
            torch.cuda.current_device() == 0 and torch.cuda.current_stream(1) == stream_of_1
        )
        optimizer.zero_grad()
    torch.cuda.synchronize(1)
    return params, optimizer, stayed


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_step_called_from_another_device_waits_for_the_gradients_device():
    """The copies wait for the stream current on the parameters' device, where the gradients
    are written, not for the current device's, and leave the caller's device current."""
    with torch.cuda.device(0):
        *late, stayed = _steps_on_second_device(late=True)
        *settled, stayed_settled = _steps_on_second_device(late=False)
    assert all(stayed) and all(stayed_settled)
    assert_same(late, settled)


@requires_cuda
def test_packed_pinned_storage_stays_within_upstreams(monkeypatch):
    """Ring slots plus pinned blocks: the process pins (in the host allocator's blocks) no
    more than the megatron-core around the fork would for the same parameters (0.19.2 keeps
    widened fp32 copies pageable, main pins them), and the blocks pinned first are the first to
    upload."""
    memory = pytest.importorskip("megatron_optimizer_fork.memory")
    memory.release_cached_pinned_memory()
    before = memory.pinned_bytes_held()
    params, optimizer = run(1.0, BUCKET_BYTES, monkeypatch, steps=1, param_update_in_fp32=True)
    memory.release_cached_pinned_memory()  # what stays held is what the optimizer's tensors use
    held = memory.pinned_bytes_held() - before
    budget = plan.upstream_pinned_bytes(
        [(h, p) for p, h in optimizer.gpu_params_map_cpu_copy.items()],
        True,
        held=True,
        pins_widened=plan.upstream_pins_widened_copies(),
    )
    assert 0 < held <= budget
    packed = packed_host_buckets(optimizer)
    pinned = [b.master.is_pinned() for b in packed]
    assert pinned == sorted(pinned, reverse=True)
    del params, optimizer
