# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Large host copies stepped and moved in parts give the whole-copy step's results exactly.

With ``host_part_bytes`` set, a host copy larger than it is cut into parts, each a bucket of the
step's pipeline: its own ring slot, download, fused AdamW over its slices and upload. Each test
runs such an optimizer beside the same one moving every copy whole, on the same inputs, and
compares parameters and state with ``torch.equal``: sizes that are not multiples of a part or a
vector, learning-rate changes, parameters left without a gradient, a step hook (which makes the
parts gather their gradients for the sub-optimizer's own step) and a loaded state.
"""

import pytest
import torch

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_buckets import CopyPart

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

build_hdo = optimizer_table.sibling("hdo_client_flows").build_hdo
assert_same = optimizer_table.sibling("test_hybrid_optimizer_packed_copies").assert_same
offloading = optimizer_table.sibling("test_optimizer_cpu_offloading")
train_drawn = offloading.train_drawn
host_buckets = offloading.host_buckets
ring_plan = offloading.ring_plan

pytestmark = pytest.mark.skipif(
    not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False), reason="the fork's buckets"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PART_BYTES = 64 << 10  # 16,384 fp32 elements
# Two copies of several parts (the last part short), one of exactly two, small ones between.
SIZES = [16, 40_001, 3, (300, 301), 32_768, 77, 16_385]


def make(part_bytes, monkeypatch, seed=0, sizes=None):
    """Parameters and an HDO over them, every copy in a bucket of its own unless small, its
    large copies moved in parts of ``part_bytes`` (0: whole). The bucket cap is fixed, not
    sized to the offload, so that ``part_bytes`` alone decides which copies move in parts."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", PART_BYTES)
    hdo_class = type("HybridDeviceOptimizer", (hybrid_optimizer.HybridDeviceOptimizer,), {})
    hdo_class.host_part_bytes = part_bytes
    hdo_class.size_host_buckets = False
    return build_hdo(hdo_class, sizes or SIZES, 1.0, seed=seed, device=DEVICE)


def train(built, steps, seed, has_grad=lambda step, index: True, between=None):
    """Drawn gradients; the learning rate changes after each step."""

    def after(opt):
        for group in opt.param_groups:
            group["lr"] *= 0.7
        if between is not None:
            between(opt)

    params, optimizer = built
    train_drawn(params, optimizer, steps, seed, has_grad=has_grad, check=after)


def stepped_in_parts(copy):
    """Whether this step ran the fused kernel part by part on ``copy`` (a copy moved in
    parts), rather than its sub-optimizer's own step over the gathered gradient."""
    return copy._settings is not None  # pylint: disable=protected-access


def parted(optimizer):
    """The copies moved in parts (there must be some), each with its buckets."""
    parts = [b for b in host_buckets(optimizer) if isinstance(b, CopyPart)]
    copies = {id(b.parted): b.parted for b in parts}
    assert copies, "no copy moves in parts"
    return list(copies.values())


def test_copies_moved_in_parts_step_exactly_as_whole_copies(monkeypatch):
    built, reference = make(PART_BYTES, monkeypatch), make(0, monkeypatch)
    train(built, 4, seed=3)
    train(reference, 4, seed=3)
    assert_same(built, reference)
    copies = parted(built[1])
    assert sorted(len(c.ranges) for c in copies) == [2, 2, 3, 6]
    assert all(c.buckets[0].part == (0, PART_BYTES // 4) for c in copies)
    assert all(stepped_in_parts(c) for c in copies)  # stepped part by part, not gathered
    buckets = host_buckets(built[1])  # each waits for its own download's event
    assert len({bucket.event_key for bucket in buckets}) == len(buckets)
    # The ring's slots hold a part at most; with whole copies one holds the largest copy.
    assert max(ring_plan(built[1]).slot_bytes) <= PART_BYTES
    assert max(ring_plan(reference[1]).slot_bytes) > PART_BYTES


def test_the_state_of_a_copy_moved_in_parts_is_its_whole_state(monkeypatch):
    params, optimizer = make(PART_BYTES, monkeypatch)
    train((params, optimizer), 3, seed=1)
    for copy in parted(optimizer):
        host = copy.host
        param = optimizer.inner_param_to_orig_param[host]
        state = optimizer.state[param]
        assert state is copy.entry and copy.optimizer.state[host] is state
        assert state["exp_avg"].shape == host.shape == state["exp_avg_sq"].shape
        assert float(state["step"]) == 3.0
        assert host.grad is None  # no part leaves a slice or a gathered buffer behind


def test_a_parameter_without_a_gradient_skips_all_its_parts(monkeypatch):
    def has_grad(step, index):
        return not (step in (1, 2) and index == 1) and not (step == 0 and index == 6)

    built, reference = make(PART_BYTES, monkeypatch), make(0, monkeypatch)
    train(built, 4, seed=5, has_grad=has_grad)
    train(reference, 4, seed=5, has_grad=has_grad)
    assert_same(built, reference)
    params, optimizer = built
    assert float(optimizer.state[params[1]]["step"]) == 2.0
    skipped = [c for c in parted(optimizer) if c.host is optimizer.param_to_inner_param[params[1]]]
    assert skipped and stepped_in_parts(skipped[0])  # its parts were stepped, not gathered


def test_a_hooked_sub_optimizer_steps_the_gathered_copy_once(monkeypatch):
    built, reference = make(PART_BYTES, monkeypatch), make(0, monkeypatch)
    train(built, 1, seed=7)
    train(reference, 1, seed=7)
    calls = []
    hooked = parted(built[1])[0]
    hooked.optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(opt))
    train(built, 3, seed=8)
    train(reference, 3, seed=8)
    assert_same(built, reference)
    assert calls == [hooked.optimizer] * 3
    # Only the hooked copy was gathered; the others went on part by part.
    assert [stepped_in_parts(c) for c in parted(built[1])].count(False) == 1
    assert not stepped_in_parts(hooked)


def test_a_loaded_state_is_stepped_in_parts(monkeypatch):
    built, reference = make(PART_BYTES, monkeypatch), make(0, monkeypatch)
    donor = make(0, monkeypatch, seed=0)
    train(built, 2, seed=1)
    train(donor, 3, seed=2)
    for target in (built, reference):
        target[1].load_state_dict(donor[1].state_dict())
        for param, source in zip(target[0], donor[0]):
            param.data.copy_(source.data)
        target[1].update_fp32_param_by_new_param()
    train(built, 2, seed=4)
    train(reference, 2, seed=4)
    assert_same(built, reference)
    assert all(stepped_in_parts(c) for c in parted(built[1]))  # the loaded state as is


@pytest.mark.parametrize("part_bytes", [1000, PART_BYTES + 64])
def test_a_part_size_off_the_alignment_is_refused(part_bytes, monkeypatch):
    params, optimizer = make(part_bytes, monkeypatch)
    for param in params:
        param.grad = torch.zeros_like(param)
    for _ in range(2):  # refused before anything is built, so again the same way
        with pytest.raises(ValueError, match="multiple of"):
            optimizer.step()


@pytest.mark.parametrize(
    "cls, in_fp32, overlap, maximize",
    [
        (torch.optim.Adam, True, True, False),
        (torch.optim.AdamW, False, True, True),
        (torch.optim.AdamW, True, False, False),
    ],
    ids=["adam", "bf16-copies-maximize", "overlap-off"],
)
def test_parts_step_exactly_in_other_settings(cls, in_fp32, overlap, maximize, monkeypatch):
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", PART_BYTES)
    built = []
    for part_bytes in (PART_BYTES, 0):
        hdo_class = type("HybridDeviceOptimizer", (hybrid_optimizer.HybridDeviceOptimizer,), {})
        hdo_class.host_part_bytes = part_bytes
        generator = torch.Generator().manual_seed(2)
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=generator).to(DEVICE, torch.bfloat16))
            for shape in SIZES
        ]
        optimizer = hdo_class(
            [{"params": params, "weight_decay": 0.1}],
            offload_fraction=1.0,
            cpu_optimizer_cls=cls,
            gpu_optimizer_cls=cls,
            param_update_in_fp32=in_fp32,
            overlap_cpu_optimizer_d2h_h2d=overlap,
            lr=torch.tensor(1e-2),
            maximize=maximize,
            fused=True,
        )
        train((params, optimizer), 3, seed=9)
        built.append((params, optimizer))
    assert_same(*built)
    assert all(stepped_in_parts(c) for c in parted(built[0][1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_parts_leave_more_copies_pinned_within_upstreams_pinned_memory(monkeypatch):
    """Eight copies of 2.4 parts each: with whole copies the ring's two slots (a third would
    leave one more copy pageable) take two copies' blocks of upstream's budget, with parts
    three slots take a part's each, so one more copy is pinned; the process still pins no more
    than upstream would."""
    memory = pytest.importorskip("megatron_optimizer_fork.memory")
    offloading.plan_pins_within_0_19_2s_budget(monkeypatch)
    pinned_copies = {}
    for part_bytes in (0, PART_BYTES):
        memory.release_cached_pinned_memory()
        before = memory.pinned_bytes_held()
        params, optimizer = make(part_bytes, monkeypatch, sizes=[40_001] * 8)
        train((params, optimizer), 1, seed=1)
        memory.release_cached_pinned_memory()
        held = memory.pinned_bytes_held() - before
        copies = list(optimizer.gpu_params_map_cpu_copy.items())
        budget = hybrid_optimizer.upstream_pinned_bytes(
            [(h, p) for p, h in copies], True, held=True
        )
        assert 0 < held <= budget
        pinned_copies[part_bytes] = sum(h.is_pinned() for _, h in copies)
        del params, optimizer
    assert pinned_copies == {0: 6, PART_BYTES: 7}


@pytest.mark.parametrize(
    "set_part_bytes", [None, PART_BYTES, 0], ids=["cap", "host_part_bytes", "whole"]
)
def test_sized_buckets_move_a_copy_larger_than_the_cap_in_parts_of_it(set_part_bytes, monkeypatch):
    """With ``size_host_buckets`` (the default) a copy larger than the sized cap (a rank's shard
    of an embedding) moves in parts of the cap, or of ``host_part_bytes`` where that is smaller,
    instead of making one bucket as large as itself, and steps as the whole copy does, bit for
    bit; ``host_part_bytes`` 0 still moves it whole. Scaled down: a 1 MiB fixed cap, 64 KiB the
    least; 1.75 MB offloaded: a cap of 128 KiB."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", 1 << 20)
    monkeypatch.setattr(hybrid_optimizer, "_LEAST_SIZED_BUCKET_BYTES", PART_BYTES)
    sizes = [1000, 24, 2048, 777] * 10 + [400_000]
    sized = type("HybridDeviceOptimizer", (hybrid_optimizer.HybridDeviceOptimizer,), {})
    if set_part_bytes is not None:  # else the default, a bucket of the fixed cap
        sized.host_part_bytes = set_part_bytes
    fixed = type("HybridDeviceOptimizer", (hybrid_optimizer.HybridDeviceOptimizer,), {})
    fixed.size_host_buckets = False
    built = build_hdo(sized, sizes, 1.0, seed=4, device=DEVICE)
    whole = build_hdo(fixed, sizes, 1.0, seed=4, device=DEVICE)
    params, optimizer = built
    buckets = host_buckets(optimizer)
    assert optimizer._host_bucket_bytes() == 2 * PART_BYTES  # pylint: disable=protected-access
    large = optimizer.param_to_inner_param[params[-1]]
    parts = [bucket for bucket in buckets if isinstance(bucket, CopyPart)]
    if set_part_bytes == 0:
        assert not parts
        assert max(bucket.nbytes for bucket in buckets) == 400_000 * 4
    else:
        part = set_part_bytes or 2 * PART_BYTES
        assert len(parts) == -(-400_000 * 4 // part)
        assert all(len(bucket.hosts) == 1 and bucket.hosts[0] is large for bucket in parts)
        assert max(bucket.nbytes for bucket in parts) == part
    for pair in (built, whole):
        train(pair, 3, seed=9)
    assert_same(built, whole)


def test_by_default_only_a_copy_larger_than_a_bucket_moves_in_parts_of_a_bucket(monkeypatch):
    """The HDO as Megatron builds it, for an offload whose sized cap is the fixed one (an
    eighth of it at least a bucket: least set to the bucket here, to keep the test small): a
    host copy larger than a bucket (a shard of an embedding or output layer) moves in parts of
    a bucket, so no ring slot has to hold it whole; a copy of exactly a bucket moves whole.
    Both step as the whole copies do, bit for bit."""
    bucket = hybrid_optimizer._HOST_BUCKET_BYTES
    monkeypatch.setattr(hybrid_optimizer, "_LEAST_SIZED_BUCKET_BYTES", bucket)
    assert hybrid_optimizer.HybridDeviceOptimizer.host_part_bytes == bucket
    assert hybrid_optimizer.HybridDeviceOptimizer.size_host_buckets
    sizes = [bucket // 4 + 4096, 1000, bucket // 4, 24]
    whole = type("HybridDeviceOptimizer", (hybrid_optimizer.HybridDeviceOptimizer,), {})
    whole.host_part_bytes = 0
    whole.size_host_buckets = False
    built = build_hdo(hybrid_optimizer.HybridDeviceOptimizer, sizes, 1.0, seed=6, device=DEVICE)
    reference = build_hdo(whole, sizes, 1.0, seed=6, device=DEVICE)
    params, optimizer = built
    large = optimizer.param_to_inner_param[params[0]]  # built on first use
    parts = [b for b in host_buckets(optimizer) if isinstance(b, CopyPart)]
    assert sorted(b.nbytes for b in parts) == [4096 * 4, bucket]
    assert all(b.hosts == [large] for b in parts)
    for pair in (built, reference):
        train(pair, 2, seed=7)
    assert_same(built, reference)
    assert max(ring_plan(optimizer).slot_bytes) == bucket
