# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HDO's host plan, made over meta tensors as for parameters on an accelerator.

No GPU is needed: a meta parameter stands for one on the accelerator, so the choice between
bucket caps by the bytes each leaves pageable, the parts of a large copy and what may be pinned
are checked on any machine, with the same functions the HDO plans its first step with.
"""

import pytest
import torch

plan_module = pytest.importorskip("megatron.core.optimizer.cpu_offloading.hybrid_optimizer_plan")
buckets_module = pytest.importorskip(
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer_buckets"
)
ring_module = pytest.importorskip("megatron.core.optimizer.cpu_offloading.hybrid_optimizer_ring")

PART_ALIGN = 64 << 10


def shards(numels):
    """fp32 host copies and bf16 parameters on the meta device, and the map between them."""
    hosts = [torch.empty(n, dtype=torch.float32, device="meta") for n in numels]
    params = [torch.empty(n, dtype=torch.bfloat16, device="meta") for n in numels]
    return hosts, params, dict(zip(hosts, params))


def buckets_of(hosts, cap):
    """Host sub-optimizers of at most ``cap`` staged bytes, as the HDO builds them."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    return HybridDeviceOptimizer.build_cpu_optimizer_list(
        torch.optim.AdamW, [{"params": hosts, "fused": True}], cap
    )


def planned(numels, caps, roomy=False, slots=3, keep_slots=False, pins_widened=False):
    """The kept plan for these shards and ``(cap, part bytes)`` choices, within the pinned budget
    of megatron-core 0.19.2 (widened copies pageable) on whichever release the test runs beside,
    or of main (``pins_widened``), or (``roomy``) one that pins everything."""
    hosts, _, param_of = shards(numels)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_module, "upstream_pins_widened_copies", lambda: pins_widened)
        if roomy:
            patch.setattr(plan_module, "upstream_pinned_bytes", lambda *_, **__: 1 << 30)
        return plan_module.plan_host(
            lambda cap: buckets_of(hosts, cap), caps, param_of, slots, True, True, keep_slots
        )


# Shards that size to a 32 KiB cap, which fills its power-of-two blocks less than 128 KiB does
# and so leaves one more copy pageable within upstream's budget.
UNEVEN = [24095, 13, 8439, 177, 6934, 30127, 168, 9736, 81]


def test_the_plan_keeps_the_cap_that_leaves_fewer_bytes_pageable():
    small, large = (1 << 15, 0), (1 << 17, 0)
    each = {cap: planned(UNEVEN, [(cap, part)]) for cap, part in (small, large)}
    assert each[1 << 15].pageable_bytes > each[1 << 17].pageable_bytes > 0
    for order in ([small, large], [large, small]):
        assert planned(UNEVEN, order).cap == 1 << 17
    # Where the two leave as much pageable, the first listed (the HDO lists the smaller) stays.
    for order in ([small, large], [large, small]):
        kept = planned(UNEVEN, order, roomy=True)
        assert kept.pageable_bytes == 0 and kept.cap == order[0][0]


def test_a_plan_stays_within_its_budget_with_the_ring_first():
    kept = planned(UNEVEN, [(1 << 15, 0), (1 << 17, 0)])
    hosts, params, _ = shards(UNEVEN)
    budget = plan_module.upstream_pinned_bytes(list(zip(hosts, params)), True, held=True)
    assert kept.budget == budget and kept.pin_slots
    ring = sum(map(plan_module.pinned_block_bytes, kept.ring_bytes))
    assert 0 < ring and ring + kept.pinned_bytes <= budget
    assert len(kept.ring_bytes) == kept.slots and max(kept.ring_bytes) <= kept.cap
    # Every offloaded copy is in one unit, pinned or counted pageable: a packed bucket's block
    # (its index) or the copy itself.
    covered = []
    for unit, _ in kept.units:
        covered += kept.buckets[unit].hosts if isinstance(unit, int) else [unit]
    assert sorted(map(id, covered)) == sorted(
        id(b_host) for b in kept.buckets for b_host in b.hosts
    )
    assert len(covered) == len(UNEVEN)


def test_a_slot_per_bucket_packs_into_shared_blocks_within_the_budget():
    """The step behind the forward queues every download at once, so every bucket keeps a slot
    of its own: packed into shared blocks they fit the budget that a block per slot (each its
    next power of two) would exceed."""
    numels = []
    for _ in range(8):  # layers of hidden 128, as the GPT case lists them
        numels += [128, 128, 3 * 128 * 128, 3 * 128, 128 * 128, 128, 128, 128]
        numels += [4 * 128 * 128, 4 * 128, 4 * 128 * 128, 128]
    kept = planned(numels, [(1 << 16, 0)], slots=len(numels), keep_slots=True)
    assert kept.slots == len(kept.staged) > 1 and kept.packed_slots
    assert kept.ring_held_bytes + kept.pinned_bytes <= kept.budget
    assert sum(map(plan_module.pinned_block_bytes, kept.ring_bytes)) > kept.budget
    block, places = ring_module.pack_slots(kept.ring_bytes)
    spans = sorted(
        (index, offset, offset + n) for (index, offset), n in zip(places, kept.ring_bytes)
    )
    for (index, _, end), (next_index, start, _) in zip(spans, spans[1:]):
        assert index != next_index or end <= start  # no two slots overlap
    assert all(offset % 4096 == 0 and end <= block for _, offset, end in spans)


def test_a_copy_larger_than_the_part_size_is_a_run_of_aligned_parts_counted_once():
    numels = [5, 3 * (PART_ALIGN // 4) + 7, 11]  # a copy of three parts and a short fourth
    kept = planned(numels, [(PART_ALIGN, PART_ALIGN)], roomy=True)
    parts = [b for b in kept.buckets if isinstance(b, buckets_module.CopyPart)]
    assert [bucket.part for bucket in parts] == [
        (start, min(start + PART_ALIGN // 4, numels[1]))
        for start in range(0, numels[1], PART_ALIGN // 4)
    ]
    assert len({id(bucket.optimizer) for bucket in parts}) == 1 and len(parts) == 4
    assert [bucket.nbytes for bucket in parts] == [PART_ALIGN] * 3 + [28]
    parted_host = parts[0].hosts[0]
    assert [unit is parted_host for unit, _ in kept.units].count(True) == 1
    # Without the part size the same copy is one bucket, as large as it is.
    whole = planned(numels, [(PART_ALIGN, 0)], roomy=True)
    assert not any(isinstance(b, buckets_module.CopyPart) for b in whole.buckets)
    assert max(bucket.nbytes for bucket in whole.buckets) == 4 * numels[1]


def test_small_copies_pack_into_one_bucket_laid_out_at_aligned_offsets():
    kept = planned([3, 5, 17], [(1 << 12, 0)], roomy=True)
    (bucket,) = kept.buckets
    assert isinstance(bucket, buckets_module.PackedCopies) and [
        offset for _, _, offset in bucket.grads
    ] == [0, 64, 128]
    assert bucket.nbytes == 128 + 4 * 17 and kept.units == [(0, bucket.nbytes)]


def test_on_a_release_that_pins_widened_copies_the_budget_pins_every_fp32_copy():
    """Megatron-LM main (0.20) pins an offloaded parameter's widened fp32 copy with
    ``pin_cpu_params``; 0.19.2 leaves it pageable. Planned against main's total, every host copy
    is pinned and none goes up through a ring slot."""
    hosts, params, _ = shards(UNEVEN)
    copies = list(zip(hosts, params))
    narrow = plan_module.upstream_pinned_bytes(copies, True, held=True)
    wide = plan_module.upstream_pinned_bytes(copies, True, held=True, pins_widened=True)
    assert wide == narrow + sum(plan_module.pinned_block_bytes(h.numel() * 4) for h in hosts)
    kept = planned(UNEVEN, [(1 << 15, 0), (1 << 17, 0)], pins_widened=True)
    assert kept.budget == wide and kept.pageable_bytes == 0
    assert sum(map(plan_module.pinned_block_bytes, kept.ring_bytes)) + kept.pinned_bytes <= wide


def test_the_release_decides_whether_widened_copies_count_as_pinned():
    from megatron.core import package_info  # pylint: disable=import-outside-toplevel

    main = (int(package_info.MAJOR), int(package_info.MINOR)) >= (0, 20)
    assert plan_module.upstream_pins_widened_copies() is main
