# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""A host bucket is stepped in one fused call, exactly as copy by copy.

Once a packed bucket's moments are views into blocks laid out like its host copies, its runs
of copies are single tensors of one fused AdamW call (``FlatAdamStep``); a bucket of one copy
is that call over the copy itself. Each test runs that
beside the straightforward optimizer (every parameter a bucket of its own, or the same buckets
stepped copy by copy) on the same inputs and compares parameters and state with
``torch.equal``, with sizes that are not multiples of a vector (whose last elements the kernel
steps one at a time), learning-rate changes, and state that clients reassign or that a load
replaces between steps.
"""

import copy

import pytest
import torch

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

build_hdo = optimizer_table.sibling("hdo_client_flows").build_hdo
counting_id_audits = optimizer_table.sibling("optimizer_doubles").counting_id_audits
assert_same = optimizer_table.sibling("test_hybrid_optimizer_packed_copies").assert_same
train_drawn = optimizer_table.sibling("test_optimizer_cpu_offloading").train_drawn
host_buckets = optimizer_table.sibling("test_optimizer_cpu_offloading").host_buckets

pytestmark = pytest.mark.skipif(
    not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False), reason="the fork's buckets"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Multiples of 16 and 32 elements (runs stepped as one tensor) between sizes that are not.
SIZES = [16, 32, 1001, 48, 77, 4096, 3, 160, 65541, 64, (8, 12), 5]
BUCKET_BYTES = 1 << 16


def make(bucket_bytes, monkeypatch, seed=0, flat=True, sizes=None):
    """Every parameter offloaded, in host buckets of ``bucket_bytes`` (0: one each), stepped
    flat or (``flat=False``) copy by copy."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", bucket_bytes)
    hdo_class = hybrid_optimizer.HybridDeviceOptimizer
    params, optimizer = build_hdo(hdo_class, sizes or SIZES, 1.0, seed=seed, device=DEVICE)
    optimizer.flat_host_steps = flat
    return params, optimizer


def train(params, optimizer, steps, seed, between=None):
    """Drawn gradients for every parameter; the learning rate changes after each step."""

    def after(opt):
        for group in opt.param_groups:
            group["lr"] *= 0.7
        if between is not None:
            between(opt)

    train_drawn(params, optimizer, steps, seed, has_grad=lambda step, index: True, check=after)


def train_beside_per_copy(bucket_bytes, monkeypatch, steps, seed, between=None):
    """Train flat and, on the same inputs and client edits, copy by copy; assert both equal and
    return the flat one's parameters and optimizer."""
    params, optimizer = make(bucket_bytes, monkeypatch)
    train(params, optimizer, steps, seed=seed, between=between)
    reference_params, reference = make(bucket_bytes, monkeypatch, flat=False)
    train(reference_params, reference, steps, seed=seed, between=between)
    assert_same((params, optimizer), (reference_params, reference))
    return params, optimizer


def flat_buckets(optimizer):
    """The buckets stepped flat (there must be some)."""
    buckets = [b for b in host_buckets(optimizer) if getattr(b, "flat", None) is not None]
    assert buckets, "no bucket is stepped flat"
    return buckets


def assert_moments_in_blocks(optimizer):
    """Every counter and moment of a bucket stepped flat is a view into that key's one block."""
    for bucket in flat_buckets(optimizer):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            storages = {optimizer.state[p][key].untyped_storage().data_ptr() for p in bucket.params}
            assert len(storages) == 1, key


@pytest.mark.parametrize("reference_bytes", [0, BUCKET_BYTES], ids=["one-each", "per-copy"])
def test_a_packed_bucket_is_stepped_flat_exactly_as_copy_by_copy(reference_bytes, monkeypatch):
    params, optimizer = make(BUCKET_BYTES, monkeypatch)
    train(params, optimizer, 5, seed=3)
    assert_moments_in_blocks(optimizer)
    reference_params, reference = make(reference_bytes, monkeypatch, flat=False)
    assert not any(getattr(bucket, "flat", None) for bucket in host_buckets(reference))
    train(reference_params, reference, 5, seed=3)
    assert_same((params, optimizer), (reference_params, reference))


def test_after_the_first_step_flat_buckets_never_call_their_sub_optimizer(monkeypatch):
    """The one fused call replaces the sub-optimizer's step, state creation included."""
    params, optimizer = make(BUCKET_BYTES, monkeypatch)
    train(params, optimizer, 1, seed=1)  # builds the buckets
    calls = []
    for bucket in flat_buckets(optimizer):
        bucket.optimizer.step = lambda *args, _b=bucket, **kwargs: calls.append(_b)
    optimizer.state.clear()  # the next step creates the state again, flat
    train(params, optimizer, 3, seed=2)
    assert not calls
    assert_moments_in_blocks(optimizer)
    reference_params, reference = make(BUCKET_BYTES, monkeypatch, flat=False)
    train(reference_params, reference, 1, seed=1)
    reference.state.clear()
    train(reference_params, reference, 3, seed=2)
    assert_same((params, optimizer), (reference_params, reference))


def test_a_bucket_of_one_copy_is_stepped_by_the_kernel_alone(monkeypatch):
    """A copy in a bucket of its own (larger than the cap; here every copy) is stepped by the
    fused kernel over the copy itself, its state created there too, never by its
    sub-optimizer after the first step, exactly as the sub-optimizer steps it."""
    params, optimizer = make(0, monkeypatch)
    train(params, optimizer, 1, seed=1)
    singles = [bucket for bucket in host_buckets(optimizer) if len(bucket.hosts) == 1]
    assert len(singles) == len(SIZES)
    assert all(bucket.flat is not None for bucket in singles)
    calls = []
    for bucket in singles:
        bucket.optimizer.step = lambda *args, _b=bucket, **kwargs: calls.append(_b)
    optimizer.state.clear()
    train(params, optimizer, 3, seed=2)
    assert not calls
    reference_params, reference = make(0, monkeypatch, flat=False)
    train(reference_params, reference, 1, seed=1)
    reference.state.clear()
    train(reference_params, reference, 3, seed=2)
    assert_same((params, optimizer), (reference_params, reference))


def test_a_copy_a_client_re_points_is_stepped_where_it_now_lives(monkeypatch):
    """A host copy whose ``.data`` is replaced between steps (as pinning or a client's move
    does) is stepped in its new memory, alone in its bucket or packed with others."""

    def re_point(optimizer):
        for host in list(optimizer.gpu_params_map_cpu_copy.values())[::2]:
            host.data = host.clone()

    for bucket_bytes in (0, BUCKET_BYTES):
        train_beside_per_copy(bucket_bytes, monkeypatch, 3, seed=4, between=re_point)


def test_a_one_copy_step_holds_the_copy_itself_and_no_view_of_its_memory(monkeypatch):
    """Memory a client takes from a copy (``.data`` replaced to free it) is not kept alive by
    the one-call step, which steps the copy object and so whatever it holds next."""
    params, optimizer = make(0, monkeypatch)
    train(params, optimizer, 1, seed=1)
    for bucket in flat_buckets(optimizer):
        host = bucket.hosts[0]
        held = [t for v in vars(bucket.flat).values() if isinstance(v, list) for t in v]
        assert any(t is host for t in held)
        storage = host.untyped_storage().data_ptr()
        views = [
            t
            for t in held
            if torch.is_tensor(t) and t is not host and t.untyped_storage().data_ptr() == storage
        ]
        assert not views


def test_state_a_client_put_in_its_own_memory_stays_there_for_one_copy(monkeypatch):
    """Moments a client assigns as views into memory of its own (at any offset) are stepped
    where they are: a bucket of one copy never moves its state into a block of its own."""
    pools = {}

    def share(optimizer):
        for param in list(optimizer.state)[::3]:
            entry = optimizer.state[param]
            if id(param) not in pools:
                pool = torch.zeros(2 * entry["exp_avg"].numel() + 8)
                pool[8 : 8 + entry["exp_avg"].numel()].copy_(entry["exp_avg"].view(-1))
                pools[id(param)] = pool
                entry["exp_avg"] = pool[8 : 8 + entry["exp_avg"].numel()].view_as(entry["exp_avg"])

    _, optimizer = train_beside_per_copy(0, monkeypatch, 3, seed=7, between=share)
    for param in list(optimizer.state)[::3]:
        value = optimizer.state[param]["exp_avg"]
        assert value.untyped_storage().data_ptr() == pools[id(param)].untyped_storage().data_ptr()


def test_runs_join_copies_of_whole_lines_and_end_at_any_other():
    flat_step = pytest.importorskip(
        "megatron.core.optimizer.cpu_offloading.hybrid_optimizer_flat_step"
    )
    layout = [
        (0, 64),
        (64, 128),
        (192, 12),  # not whole lines: ends its run (its partial vector stays last)
        (256, 64),
        (320, 32),  # ends the run it joins
        (384, 192),
        (640, 64),  # a gap before it: a new run
    ]
    assert flat_step.flat_runs(layout) == [(0, 0, 204), (3, 256, 352), (5, 384, 576), (6, 640, 704)]


def test_moments_a_client_assigns_are_stepped_and_laid_out_again(monkeypatch):
    """Assigned tensors (new objects, scaled values) are what the next step uses; they are
    then moved into the block, where the next assignment finds them."""

    def reassign(optimizer):
        for param in list(optimizer.state)[::2]:
            entry = optimizer.state[param]
            entry["exp_avg"] = entry["exp_avg"] * 0.5
            entry["exp_avg_sq"] = entry["exp_avg_sq"].clone()

    params, optimizer = make(BUCKET_BYTES, monkeypatch)
    train(params, optimizer, 4, seed=5, between=reassign)
    reference_params, reference = make(BUCKET_BYTES, monkeypatch, flat=False)
    train(reference_params, reference, 4, seed=5, between=reassign)
    assert_same((params, optimizer), (reference_params, reference))
    train(params, optimizer, 1, seed=6)
    assert_moments_in_blocks(optimizer)


def test_a_loaded_state_dict_is_stepped_as_saved(monkeypatch):
    """A state dict saved after flat steps and loaded into a fresh optimizer resumes
    exactly as the optimizer that kept going (and as one stepped copy by copy)."""
    params, optimizer = make(BUCKET_BYTES, monkeypatch)
    train(params, optimizer, 3, seed=1)
    saved = copy.deepcopy(optimizer.state_dict())  # its tensors are the live state
    values = [p.detach().clone() for p in params]
    train(params, optimizer, 2, seed=2)

    resumed_params, resumed = make(BUCKET_BYTES, monkeypatch, seed=9)
    with torch.no_grad():
        for param, value in zip(resumed_params, values):
            param.copy_(value)
    resumed.load_state_dict(saved)
    train(resumed_params, resumed, 2, seed=2)
    assert_same((resumed_params, resumed), (params, optimizer))
    assert_moments_in_blocks(resumed)


# Ways a client writes a counter: in place, and two that leave the tensor's version as it was
# (as a collective such as a broadcast of rank 0's state does).
COUNTER_WRITES = {
    "in place": lambda counter: counter.fill_(1.0),
    "through .data": lambda counter: counter.data.fill_(1.0),
    ".data assigned": lambda counter: setattr(counter, "data", torch.ones((), dtype=counter.dtype)),
}


@pytest.mark.parametrize("write", sorted(COUNTER_WRITES))
def test_counters_that_differ_step_copy_by_copy(write, monkeypatch):
    """Copies whose counters differ (a client reset one, however) cannot share a step: each
    copy then gets its own bias correction, as stepped copy by copy."""

    def reset_one(optimizer):
        for param in list(optimizer.state)[1:4]:  # inside runs, not only at their start
            COUNTER_WRITES[write](optimizer.state[param]["step"])

    train_beside_per_copy(BUCKET_BYTES, monkeypatch, 3, seed=4, between=reset_one)


def test_counters_a_client_assigns_are_stepped_and_laid_out_again(monkeypatch):
    """New counter tensors (here a restart of some copies' bias correction) are what the next
    step counts with; once they agree again they are gathered into one vector."""

    def assign(optimizer):
        for param in list(optimizer.state)[2:5]:
            optimizer.state[param]["step"] = torch.tensor(1.0)

    params, optimizer = make(BUCKET_BYTES, monkeypatch)
    train(params, optimizer, 3, seed=2, between=assign)
    reference_params, reference = make(BUCKET_BYTES, monkeypatch, flat=False)
    train(reference_params, reference, 3, seed=2, between=assign)
    assert_same((params, optimizer), (reference_params, reference))
    for entry in optimizer.state.values():
        entry["step"] = torch.tensor(4.0)
    train(params, optimizer, 2, seed=3)
    assert_moments_in_blocks(optimizer)
    for entry in reference.state.values():
        entry["step"] = torch.tensor(4.0)
    train(reference_params, reference, 2, seed=3)
    assert_same((params, optimizer), (reference_params, reference))


def test_moments_that_share_memory_keep_sharing_it(monkeypatch):
    """Two entries holding views of the same memory (a client tied them) stay tied, stepped
    as the sub-optimizer steps them: the flat step does not lay them out apart."""

    def tie(params):
        def tie_once(optimizer):
            entries = [optimizer.state[p] for p in params]
            if not tied:
                entries[4]["exp_avg"] = entries[3]["exp_avg"].view(-1)
                tied.append(True)

        tied = []
        return tie_once

    sizes = SIZES[:3] + [64, 64, 64] + SIZES[3:]  # in the second group, in one run
    params, optimizer = make(BUCKET_BYTES, monkeypatch, sizes=sizes)
    train(params, optimizer, 4, seed=5, between=tie(params))
    entries = [optimizer.state[p] for p in params]
    assert entries[3]["exp_avg"].data_ptr() == entries[4]["exp_avg"].data_ptr()
    reference_params, reference = make(BUCKET_BYTES, monkeypatch, flat=False, sizes=sizes)
    train(reference_params, reference, 4, seed=5, between=tie(reference_params))
    assert_same((params, optimizer), (reference_params, reference))


def test_a_group_the_sub_optimizer_refuses_is_refused_alike(monkeypatch):
    """``foreach`` beside ``fused`` with a tensor learning rate: torch's own step raises, so
    the flat step must not go ahead in its place."""
    params, optimizer = make(BUCKET_BYTES, monkeypatch, sizes=[16, 32, 48, 64] * 4)
    train(params, optimizer, 2, seed=1)
    assert all(getattr(b, "flat", None) is not None for b in host_buckets(optimizer))
    for sub in optimizer.cpu_optimizers:
        sub.param_groups[0]["foreach"] = True
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(group["lr"])
    with pytest.raises(RuntimeError, match="foreach"):
        train(params, optimizer, 1, seed=2)


def test_held_moments_stay_the_state_that_is_stepped(monkeypatch):
    """A moment a client holds from before the blocks were laid out is still the entry's
    tensor afterwards, stepped in place (torch's optimizers keep state objects)."""
    params, optimizer = make(BUCKET_BYTES, monkeypatch)
    train(params, optimizer, 1, seed=3)
    held = {p: optimizer.state[p]["exp_avg"] for p in params}
    train(params, optimizer, 3, seed=4)
    assert_moments_in_blocks(optimizer)
    reference_params, reference = make(0, monkeypatch)
    train(reference_params, reference, 1, seed=3)
    train(reference_params, reference, 3, seed=4)
    for param, ref in zip(params, reference_params):
        assert held[param] is optimizer.state[param]["exp_avg"]
        assert torch.equal(held[param], reference.state[ref]["exp_avg"])


@pytest.mark.parametrize("change", ["data", "swap"])
def test_moments_re_pointed_or_swapped_by_a_client_are_stepped(change, monkeypatch):
    """``.data`` replaced with other values, or two same-sized parameters' moments exchanged
    (an expert permutation): the next step uses exactly what the entries then hold."""

    def edit(optimizer):
        entries = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
        if change == "data":
            for entry in entries:
                entry["exp_avg"].data = entry["exp_avg"] * 0.5
        else:
            first, second = entries  # SIZES[0] and SIZES[1] hold whole lines: one run
            first["exp_avg"], second["exp_avg"] = second["exp_avg"][:16], first["exp_avg"][:16]

    sizes = [16, 16] + SIZES[2:]

    params, optimizer = make(BUCKET_BYTES, monkeypatch, sizes=sizes)
    train(params, optimizer, 4, seed=5, between=edit)
    train(params, optimizer, 1, seed=6)
    assert_moments_in_blocks(optimizer)
    reference_params, reference = make(0, monkeypatch, sizes=sizes)
    train(reference_params, reference, 4, seed=5, between=edit)
    train(reference_params, reference, 1, seed=6)
    assert_same((params, optimizer), (reference_params, reference))


def test_cleared_state_leaves_no_block_behind(monkeypatch):
    """The entries' tensors are the moment blocks' only owners: the flat step keeps no view
    of them, so cleared state frees them."""
    params, optimizer = make(BUCKET_BYTES, monkeypatch)
    train(params, optimizer, 3, seed=1)
    blocks = {
        optimizer.state[p][key].untyped_storage().data_ptr()
        for bucket in flat_buckets(optimizer)
        for p in bucket.params
        for key in ("exp_avg", "exp_avg_sq")
    }
    for bucket in flat_buckets(optimizer):
        held = [value for value in vars(bucket.flat).values() if isinstance(value, list)]
        for tensor in (t for values in held for t in values if torch.is_tensor(t)):
            assert tensor.untyped_storage().data_ptr() not in blocks


def test_step_hooks_of_a_host_sub_optimizer_run(monkeypatch):
    params, optimizer = make(BUCKET_BYTES, monkeypatch)
    train(params, optimizer, 1, seed=1)
    calls = []
    for sub in optimizer.cpu_optimizers:
        sub.register_step_post_hook(lambda opt, args, kwargs: calls.append(opt))
    train(params, optimizer, 2, seed=2)
    assert len(calls) == 2 * len(optimizer.cpu_optimizers)
    reference_params, reference = make(BUCKET_BYTES, monkeypatch, flat=False)
    train(reference_params, reference, 1, seed=1)
    train(reference_params, reference, 2, seed=2)
    assert_same((params, optimizer), (reference_params, reference))


def test_the_flat_step_looks_at_its_state_without_an_id_per_tensor(monkeypatch):
    """Each step checks that the state is still the tensors it laid out. It names them without
    ``id``, whose audit event runs every installed audit hook in Python (filelock, which torch
    and megatron import, installs one): on thousands of shards, milliseconds a step."""
    params, optimizer = make(BUCKET_BYTES, monkeypatch)
    train(params, optimizer, 2, seed=4)  # the state is laid out in blocks from here on
    buckets = flat_buckets(optimizer)
    tensors = sum(len(bucket.hosts) for bucket in buckets)
    for param in params:
        param.grad = torch.ones_like(param)
    with counting_id_audits() as audits:
        optimizer.step()
    assert all(bucket.flat._seen is not None for bucket in buckets)  # stepped flat
    assert audits["count"] < tensors, (audits["count"], tensors)
