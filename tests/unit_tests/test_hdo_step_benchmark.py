# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HDO step benchmark's arithmetic: both limits and the ratios it prints (CPU)."""

import gc
import json
import sys
import types
from pathlib import Path

import pytest
import torch

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

load_tool = optimizer_table.sibling("fork_tools").load_tool

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if not (BENCHMARKS / "hdo_step.py").is_file():
    pytest.skip("no benchmarks/ here (a vendored tree)", allow_module_level=True)
sys.path.insert(0, str(BENCHMARKS))  # the benchmark imports its cases as a sibling module
benchmark = load_tool("../benchmarks/hdo_step.py", "hdo_step_benchmark")


def test_the_contended_limit_takes_adam_as_timed_beside_the_copies():
    floor = {"adam": 0.10, "d2h": 0.02, "h2d": 0.03, "adam_beside_copies": 0.125}
    result = {"step": 0.15, "step_min": 0.14, "step_max": 0.16, "outside": 0.0}
    result.update(pinned_held=0, pinned_live=0)
    row = benchmark.row_of("stress", 0.5, True, "fork", result, floor, True)
    assert row["floor_s"] == pytest.approx(0.15) and row["limit_s"] == 0.10
    assert row["limit_contended_s"] == 0.125
    assert row["ratio_limit"] == pytest.approx(1.5)
    assert row["ratio_contended"] == pytest.approx(1.2)
    # Copies slower than AdamW even beside them: the copies are the limit.
    slow_bus = dict(floor, d2h=0.2)
    assert benchmark.row_of("x", 1.0, True, "fork", result, slow_bus, True)[
        "limit_contended_s"
    ] == pytest.approx(0.2)


def test_the_fp32_contended_bound_takes_adam_beside_the_fp32_copies():
    """Apart from the issue's bf16 bounds, the bound of a pipeline that moves fp32 both ways:
    AdamW timed beside fp32 copies, or those copies where they take longer."""
    floor = {"adam": 0.10, "d2h": 0.02, "h2d": 0.03, "adam_beside_copies": 0.11}
    floor.update(adam_beside_fp32_copies=0.125, d2h_fp32=0.04, h2d_fp32=0.06)
    result = {"step": 0.15, "step_min": 0.14, "step_max": 0.16, "outside": 0.0}
    result.update(pinned_held=0, pinned_live=0)
    row = benchmark.row_of("gpt", 1.0, True, "fork", result, floor, True)
    assert row["limit_contended_s"] == 0.11 and row["limit_fp32_contended_s"] == 0.125
    assert row["ratio_fp32_contended"] == pytest.approx(1.2)
    wide_slow = dict(floor, h2d_fp32=0.3)
    assert benchmark.row_of("gpt", 1.0, True, "fork", result, wide_slow, True)[
        "limit_fp32_contended_s"
    ] == pytest.approx(0.3)
    cells = {name: cell(row) for name, _, cell in benchmark.COLUMNS}
    assert cells["/fp32 contended"] == "1.20" and cells["adam|fp32 s"] == "0.125"


def test_collector_pauses_inside_timed_steps_are_counted_apart_and_warm_up_ones_are_not(
    monkeypatch,
):
    """A collection that lands in a timed call is reported as ``gc``; those of the warm-up
    calls and of ``before`` are not; one full collection runs between the warm-up and the
    first timed call."""
    calls = []

    def collecting_when_timed():
        calls.append(None)
        if len(calls) > 1:  # one warm-up call, then the timed ones
            gc.collect()

    assert benchmark.timed(collecting_when_timed, "cpu", repeats=3, warmup=1)["gc"] > 0
    warm = []

    def collecting_when_warm():
        warm.append(None)
        if len(warm) <= 2:  # the two warm-up calls
            gc.collect()

    quiet = benchmark.timed(collecting_when_warm, "cpu", repeats=3, warmup=2, before=gc.collect)
    assert quiet["gc"] == 0.0
    order = []
    spy = types.SimpleNamespace(collect=lambda: order.append("collect"), callbacks=gc.callbacks)
    monkeypatch.setattr(benchmark, "gc", spy)
    benchmark.timed(lambda: order.append("call"), "cpu", repeats=2, warmup=2)
    assert order == ["call", "call", "collect", "call", "call"]
    result = {"step": 0.15, "step_min": 0.14, "step_max": 0.16, "outside": 0.0, "gc": 0.25}
    result.update(pinned_held=0, pinned_live=0)
    floor = {"adam": 0.10, "d2h": 0.02, "h2d": 0.03, "adam_beside_copies": 0.125}
    row = benchmark.row_of("stress", 0.5, True, "fork", result, floor, True)
    assert {name: cell(row) for name, _, cell in benchmark.COLUMNS}["gc s"] == "0.250"


def test_the_flat_adam_blocks_cover_the_elements_in_bucket_sized_pieces():
    assert benchmark.flat_blocks(10, block_numel=4) == [4, 4, 2]
    assert benchmark.flat_blocks(8, block_numel=4) == [4, 4]
    numel = 3 * benchmark.FLAT_BLOCK_NUMEL + 5
    assert sum(benchmark.flat_blocks(numel)) == numel
    assert len(benchmark.flat_blocks(numel)) == 4
    # pylint: disable-next=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    # fp32 bytes of one fork HDO bucket
    assert benchmark.FLAT_BLOCK_NUMEL * 4 == hybrid_optimizer._HOST_BUCKET_BYTES


def test_the_flat_adam_time_is_measured_and_printed_beside_the_limits():
    args = benchmark.parse_args(["--case", "stress", "--scale", "0.001", "--repeats", "1"])
    args.case = "stress"  # main() runs the cases one at a time
    floor = benchmark.measure_floor(args, "cpu", 1.0)
    assert floor["adam_flat"] > 0.0
    result = {"step": 0.15, "step_min": 0.14, "step_max": 0.16, "outside": 0.0}
    result.update(pinned_held=0, pinned_live=0)
    row = benchmark.row_of("stress", 1.0, True, "fork", result, floor, True)
    assert row["limit_s"] == max(floor["adam"], floor["d2h"], floor["h2d"])
    cells = {name: cell(row) for name, _, cell in benchmark.COLUMNS}
    assert cells["adam flat s"] == f"{floor['adam_flat']:.3f}"


def test_host_adam_is_timed_again_after_the_rows_and_the_limits_take_the_mean(
    monkeypatch, tmp_path
):
    """Host AdamW's speed drifts while the rows run, so it is timed before and after a
    fraction's rows (every overlap), and the floor and limit take the mean of the two."""
    events = []

    def worker(args, name, fraction, overlap):
        events.append(("row", overlap))
        result = {"step": 0.2, "step_min": 0.19, "step_max": 0.21, "outside": 0.0}
        return {**result, "pinned_held": 0, "pinned_live": 0, "digest": "same"}

    def again(args, device, fraction, floor):
        events.append("again")
        # AdamW really runs again; its time is read as 0.25 s, so that nothing here depends on
        # how fast (or how loaded) the machine is.
        with monkeypatch.context() as patch:
            patch.setattr(benchmark, "timed", timed_as_quarter)
            return real_again(args, device, fraction, {**floor, "adam": 1.0})

    def timed_as_quarter(fn, device, repeats):
        events.append("timed again")
        return {**real_timed(fn, device, repeats), "median": 0.25}

    real_again, real_timed = benchmark.adam_again, benchmark.timed
    monkeypatch.setattr(benchmark, "run_worker", worker)
    monkeypatch.setattr(benchmark, "adam_again", again)
    argv = ["--case", "stress", "--scale", "0.001", "--repeats", "1", "--fractions", "1.0"]
    argv += ["--overlap", "both", "--skip-upstream", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["hdo_step.py", *argv])
    benchmark.main()
    assert events == [("row", True), ("row", False), "again", "timed again"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    saved = json.loads((tmp_path / f"hdo_step_{device}.json").read_text())
    assert saved["device"].endswith(f", host {benchmark.host_processor()}")  # machines differ
    rows = saved["rows"]
    assert len(rows) == 2
    for row in rows:
        floor = row["floor"]
        assert floor["adam_before"] == 1.0 and floor["adam_after"] == 0.25
        assert floor["adam"] == (1.0 + 0.25) / 2
        assert row["limit_s"] == max(floor["adam"], floor["d2h"], floor["h2d"])
        assert row["ratio_limit"] == 0.2 / row["limit_s"]
        cells = {name: cell(row) for name, _, cell in benchmark.COLUMNS}
        assert cells["before/after s"] == f"1.000/{floor['adam_after']:.3f}"


def test_a_fork_tree_row_times_that_checkout_s_modules_exactly_as_the_installed_fork():
    """``--fork-tree`` rows load the HDO from another checkout's ``megatron/`` in their worker
    (here this repository's own, beside the installed overlay) and step the same values."""
    if "/_overlay/" not in (benchmark.defining_file(benchmark.fork_class()) or ""):
        pytest.skip("the fork is not served by the installed overlay here")
    root = str(BENCHMARKS.parent)
    args = benchmark.parse_args(
        ["--case", "gpt", "--scale", "0.0005", "--repeats", "1", "--warmup", "1"]
    )
    args.case = "gpt"  # main() runs the cases one at a time
    installed = benchmark.run_worker(args, "fork", 0.5, True)
    tree = benchmark.run_worker(args, benchmark.TREE_PREFIX + root, 0.5, True)
    assert "/_overlay/" in installed["module"]
    assert tree["module"].startswith(root + "/megatron/")
    assert tree["digest"] == installed["digest"]
    with pytest.raises(RuntimeError, match="no megatron/core/optimizer there"):
        benchmark.run_worker(args, benchmark.TREE_PREFIX + str(BENCHMARKS), 0.5, True)


def test_a_bucket_row_steps_smaller_host_buckets_to_the_same_values():
    """``--bucket-mib`` rows cut the host copies into buckets (and parts) of that size in their
    worker alone, and step the same values as the default's 64 MiB buckets."""
    args = benchmark.parse_args(
        ["--case", "gpt", "--scale", "0.004", "--repeats", "1", "--warmup", "1"]
    )
    args.case = "gpt"  # main() runs the cases one at a time
    default = benchmark.run_worker(args, "fork", 1.0, True)
    small = benchmark.run_worker(args, benchmark.BUCKET_PREFIX + "1", 1.0, True)
    assert small["digest"] == default["digest"]
    assert default["host_optimizers"] == 1  # about 8 MiB of fp32 copies
    assert small["host_optimizers"] >= 8
    assert benchmark.parse_args(["--bucket-mib", "4", "16"]).bucket_mib == [4, 16]


def test_paired_rows_hold_each_step_against_adamw_timed_around_its_run():
    """``--paired K`` times host AdamW alone in blocks of K around each run of K timed steps,
    in the row's own process; each step's reference is the mean of the two blocks' medians,
    and the row's /paired is the median of each step over the limit taken with it."""
    calls = []
    times = benchmark.timed(
        lambda: calls.append("step"), "cpu", 3, warmup=2, beside=lambda: calls.append("adam")
    )
    assert calls == ["step", "adam", "step"] + ["adam", "step"] * 3 + ["adam"]
    assert len(times["times"]) == len(times["beside"]) == 3
    assert [len(block) for block in times["beside_blocks"]] == [1, 1, 1, 1]
    calls.clear()
    times = benchmark.timed(
        lambda: calls.append("step"),
        "cpu",
        5,
        warmup=1,
        beside=lambda: calls.append("adam"),
        block=2,
    )
    runs = ["adam", "adam", "step", "step"]
    assert calls == ["adam", "step"] + runs * 2 + ["adam", "adam", "step", "adam", "adam"]
    assert [len(block) for block in times["beside_blocks"]] == [2, 2, 2, 2]
    assert len(times["beside"]) == 5
    # Medians 0.1, 0.3, 0.2 and 0.4: the runs' references 0.2, 0.25, 0.3.
    blocks = [[0.1, 0.1], [0.2, 0.4], [0.2, 0.2], [0.4, 0.4]]
    references = benchmark.block_references(blocks, 2, 5)
    assert references == pytest.approx([0.2, 0.2, 0.25, 0.25, 0.3])

    floor = {"adam": 0.1, "d2h": 0.08, "h2d": 0.06, "adam_beside_copies": 0.1}
    result = {"step": 0.25, "step_min": 0.2, "step_max": 0.3, "outside": 0.0}
    result.update(pinned_held=0, pinned_live=0)
    result["paired"] = [[0.2, 0.1], [0.3, 0.2], [0.25, 0.05]]  # the last one: D2H is longer
    row = benchmark.row_of("gpt", 1.0, True, "fork", result, floor, True)
    assert row["ratio_paired"] == 2.0  # the median of 2.0, 1.5 and 0.25 / 0.08
    assert row["paired_adam_s"] == 0.1
    unpaired = benchmark.row_of("gpt", 1.0, True, "fork", {**result, "paired": []}, floor, True)
    assert unpaired["ratio_paired"] is None
    assert {name: cell(unpaired) for name, _, cell in benchmark.COLUMNS}["/paired"] == "-"

    args = benchmark.parse_args(
        ["--case", "stress", "--scale", "0.001", "--repeats", "2", "--warmup", "1", "--paired"]
    )
    args.case = "stress"  # main() runs the cases one at a time
    worker = benchmark.run_worker(args, "fork", 0.5, True)
    assert len(worker["paired"]) == 2 and all(adam > 0 for _, adam in worker["paired"])
    assert [len(block) for block in worker["paired_blocks"]] == [1, 1, 1]
    args.paired = 2
    worker = benchmark.run_worker(args, "fork", 0.5, True)
    assert [len(block) for block in worker["paired_blocks"]] == [2, 2]
    args.paired = 0
    assert benchmark.run_worker(args, "fork", 0.5, True)["paired"] == []
    assert benchmark.parse_args(["--paired", "3"]).paired == 3
    assert benchmark.parse_args([]).paired == 0


def test_rounds_combine_into_one_row_keeping_every_process_s_steps_and_blocks():
    """``--rounds``: one implementation's processes become one row, the median of their median
    steps, the extremes of all their steps, the most pinned memory any held, and every paired
    step and AdamW block of every process."""
    rounds = []
    for step, low, high, pinned in (
        (0.2, 0.18, 0.3, 10),
        (0.4, 0.35, 0.5, 30),
        (0.3, 0.1, 0.31, 20),
    ):
        rounds.append(
            {
                "step": step,
                "step_min": low,
                "step_max": high,
                "outside": step / 100,
                "gc": 0.001,
                "worker_s": 5.0,
                "pinned_held": pinned,
                "pinned_live": pinned - 1,
                "paired": [[step, step / 2]],
                "paired_blocks": [[step / 2], [step / 3]],
            }
        )
    result = benchmark.combined(rounds)
    assert result["step"] == 0.3 and result["step_per_process"] == [0.2, 0.4, 0.3]
    assert (result["step_min"], result["step_max"]) == (0.1, 0.5)
    assert (result["pinned_held"], result["pinned_live"]) == (30, 29)
    assert result["outside"] == 0.003 and result["worker_s"] == 15.0
    assert result["paired"] == [[0.2, 0.1], [0.4, 0.2], [0.3, 0.15]]
    assert len(result["paired_blocks"]) == 6 and result["paired_blocks"][2] == [0.2]


def test_decoupled_gradients_are_views_of_one_fp32_buffer_with_the_same_values():
    """``--grads decoupled`` hands the HDO what the precision-aware distributed optimizer does:
    parameters viewing one bf16 buffer, fp32 gradients viewing another (both back to front),
    the same values as ``--grads model``; an HDO stepped either way ends with the same
    parameters."""
    args = benchmark.parse_args(["--case", "gpt", "--scale", "0.0005", "--grads", "decoupled"])
    args.case = "gpt"  # main() runs the cases one at a time
    params, grads = benchmark.parameters_and_gradients(args, "cpu")
    args.grads = "model"
    own_params, own_grads = benchmark.parameters_and_gradients(args, "cpu")
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
    assert all(g.dtype == torch.float32 for g in grads)
    # Back to front, as DDP's buffers: each shard ends where the one before it in the list starts.
    for tensors in (params, grads):
        for before, after in zip(tensors, tensors[1:]):
            assert after.data_ptr() + after.nbytes == before.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(params, own_params))
    assert all(torch.equal(a, b.float()) for a, b in zip(grads, own_grads))
    args.repeats, args.warmup = 1, 1
    digests = set()
    for layout in ("model", "decoupled"):
        args.grads = layout
        digests.add(benchmark.run_worker(args, "fork", 0.5, True)["digest"])
    assert len(digests) == 1


def _stepped_hdo(numels, device, fraction):
    """Parameters of ``numels`` elements on ``device``, the fork's HDO over them stepped once,
    and what hands out their gradients (skips where the module is upstream's: the breakdown
    times the fork's own methods)."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    if not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False):
        pytest.skip("the parts are the fork's methods")
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in numels]
    hdo = hybrid_optimizer.HybridDeviceOptimizer(
        [{"params": params}],
        offload_fraction=fraction,
        lr=1e-3,
        cpu_optimizer_cls=torch.optim.AdamW,
    )

    def grads():
        for param in params:
            param.grad = torch.ones_like(param)

    grads()
    hdo.step()
    return params, hdo, grads


def test_the_breakdown_times_the_fork_s_parts_and_puts_them_back():
    """The parts are timed within the step and the optimizer is left as it was: its methods
    are its class's again, and a later step runs untimed."""
    split = load_tool("../benchmarks/hdo_step_breakdown.py", "hdo_step_breakdown")
    params, hdo, grads = _stepped_hdo((64, 3, 1000), "cpu", 0.5)
    parts = split.breakdown(hdo, grads, steps=2)
    expected = {"step", "host step", "download queueing", "upload staging", "upload queueing"}
    assert expected <= set(parts)
    assert sum(v for k, v in parts.items() if k != "step") <= parts["step"] * 1.01
    assert "_download" not in vars(hdo)
    assert hdo.cpu_optimizers and all("step" not in vars(host) for host in hdo.cpu_optimizers)
    assert split.breakdown(torch.optim.AdamW(params), grads) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the waits are for CUDA copies")
def test_the_breakdown_times_the_step_s_waits_for_the_copies_apart():
    """Offloaded to the host, the step waits for each bucket's download and for its last
    uploads; both waits are reported, inside the step's time, and the classes are restored."""
    split = load_tool("../benchmarks/hdo_step_breakdown.py", "hdo_step_breakdown")
    _, hdo, grads = _stepped_hdo((1 << 20, 4096, 1 << 18), "cuda", 1.0)
    originals = {waiter: vars(waiter)["synchronize"] for waiter in split.WAITS}
    parts = split.breakdown(hdo, grads, steps=2)
    assert {"download wait", "last upload wait"} <= set(parts)
    assert sum(v for k, v in parts.items() if k != "step") <= parts["step"] * 1.01
    assert all(vars(waiter)["synchronize"] is originals[waiter] for waiter in split.WAITS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the waits are for CUDA copies")
def test_a_download_held_up_on_its_stream_is_reported_as_the_download_wait():
    """A kernel queued on the download stream ahead of each step's first download keeps the
    host waiting for those gradients: the time shows as the download wait, the waits being
    told apart (the last uploads' wait stays short)."""
    # pylint: disable=protected-access
    split = load_tool("../benchmarks/hdo_step_breakdown.py", "hdo_step_breakdown")
    _, hdo, grads = _stepped_hdo((1 << 20, 4096, 1 << 18), "cuda", 1.0)
    queue_download, first = hdo._download, hdo._ring.plan.first_downloads[0]

    def held_up(index):
        if index == first:
            with torch.cuda.stream(hdo._d2h_stream):
                torch.cuda._sleep(100_000_000)  # at least 50 ms at a 2 GHz clock
        queue_download(index)

    hdo._download = held_up
    try:
        parts = split.breakdown(hdo, grads, steps=2)
    finally:
        del hdo._download
    assert parts["download wait"] >= 25.0
    assert parts["last upload wait"] < parts["download wait"] / 4


def test_the_host_thread_benchmark_steps_every_bucket_on_the_worker_as_on_the_caller():
    threads = load_tool("../benchmarks/host_adam_threads.py", "host_adam_threads")
    on_caller, on_worker = (threads.HostBuckets(3, 64, 4) for _ in range(2))
    on_caller.step_all()
    threads._on_worker(on_worker, threads.CallerWork(64), True)  # pylint: disable=protected-access
    for first, second in zip(on_caller.optimizers, on_worker.optimizers):
        for a, b in zip(first.param_groups[0]["params"], second.param_groups[0]["params"]):
            assert torch.equal(a, b) and not torch.equal(a, torch.zeros_like(a))
    times = threads.main(["--buckets", "2", "--bucket-numel", "256", "--repeats", "2"])
    assert len(times) == 5 and all(len(s) == 2 and min(s) > 0 for s in times.values())


def test_the_flat_step_benchmark_times_both_ways_over_the_same_buckets_and_values():
    """Its two rows step the same buckets: flat ones that never fall back, and per-copy ones
    that give the same values."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    if not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False):
        pytest.skip("the flat step is the fork's")
    flat_step = load_tool("../benchmarks/flat_step.py", "flat_step_benchmark")
    flat, per_copy = (flat_step.build(40, 48, flat) for flat in (True, False))
    for optimizer, stepped_flat in ((flat, True), (per_copy, False)):
        assert flat_step.timed_ms(flat_step.host_steps(optimizer, stepped_flat), 2)[0] > 0
    # One host sub-optimizer a bucket: both rows hold the same buckets of the same copies.
    flat_buckets, per_copy_buckets = (
        [[p.shape for group in host.param_groups for p in group["params"]] for host in hosts]
        for hosts in (flat.cpu_optimizers, per_copy.cpu_optimizers)
    )
    assert flat_buckets == per_copy_buckets
    for a, b in zip(flat.param_groups[0]["params"], per_copy.param_groups[0]["params"]):
        host_a, host_b = (opt.param_to_inner_param[p] for opt, p in ((flat, a), (per_copy, b)))
        assert torch.equal(host_a, host_b)


def test_the_pinning_plan_tool_plans_the_buckets_and_ring_the_hdo_builds(monkeypatch):
    """The tool asks the HDO's planner for what an HDO over the same shards asks it for (whole
    copies, in parts, sized buckets: each cap weighed, its buckets, parts and pinnable copies)
    and reports the plan the HDO keeps. On the CPU the HDO pins nothing, so its ring is not
    trimmed to a budget: the plans' inputs are compared, not their outcome."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    if not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False):
        pytest.skip("the fork's buckets")
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer_plan

    pin_plan = load_tool("../benchmarks/hdo_pin_plan.py", "hdo_pin_plan")
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", 1 << 17)
    asked = []
    planner = hybrid_optimizer_plan.plan_pinned_host_memory

    def recorded(bucket_nbytes, master_nbytes, budget, max_slots, *args, **kwargs):
        asked.append((list(bucket_nbytes), list(master_nbytes), max_slots))
        return planner(bucket_nbytes, master_nbytes, budget, max_slots, *args, **kwargs)

    monkeypatch.setattr(hybrid_optimizer_plan, "plan_pinned_host_memory", recorded)
    numels = [16, 40_001, 3, 90_300, 32_768, 77, 16_385, 5]
    monkeypatch.setattr(hybrid_optimizer, "_LEAST_SIZED_BUCKET_BYTES", 1 << 12)
    ways = [(0, False), (1 << 16, False), (1 << 17, True)]  # whole, parts, sized buckets
    for part_bytes, sized in ways:
        hdo_class = type("HDO", (hybrid_optimizer.HybridDeviceOptimizer,), {})
        hdo_class.host_part_bytes = part_bytes
        hdo_class.size_host_buckets = sized
        params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in numels]
        optimizer = hdo_class(
            [{"params": params}],
            offload_fraction=0.8,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            param_update_in_fp32=True,
            fused=True,
        )
        asked.clear()
        optimizer._init_sub_optimizers()  # pylint: disable=protected-access
        built = list(asked)
        asked.clear()
        figures = pin_plan.plan(numels, 0.8, part_bytes, sized)
        # The HDO on the CPU has no accelerator copies to pin; the tool's are all of them.
        assert [(b, s) for b, _, s in built] == [(b, s) for b, _, s in asked], (part_bytes, sized)
        assert len(built) == (2 if sized else 1) and all(masters for _, masters, _ in asked)
        staged = [b for b in optimizer._buckets if b.grads]
        assert figures["buckets"] == len(staged) > 1
        assert figures["cap"] * (1 << 20) == optimizer._host_plan.cap
        if part_bytes:
            assert len(staged) > len(optimizer.cpu_optimizers)  # the largest copy is parted
        if sized:  # an eighth of the offloaded bytes is below the fixed cap here
            assert figures["cap"] * (1 << 20) < hybrid_optimizer._HOST_BUCKET_BYTES


def _stepped_plainly_and_by(stepping):
    """Two ``host_adam_dma.HostAdam`` of the same values: one after its plain step, one after
    ``stepping(adam)``; the first values of the second, as they were."""
    import host_adam_dma  # pylint: disable=import-outside-toplevel

    results = []
    for step in (host_adam_dma.HostAdam.step_all, stepping):
        torch.manual_seed(0)
        adam = host_adam_dma.HostAdam(tensors=3, numel=4096 + 64)
        before = adam.params[0].clone()
        step(adam)
        results.append(adam)
    for a, b in zip(*(adam.params + adam.exp_avgs + adam.exp_avg_sqs for adam in results)):
        assert torch.equal(a, b)
    return results[1], before


def test_the_narrowing_benchmark_steps_every_tensor_and_stages_its_bf16_master():
    """``host_adam_dma.py``'s host-narrowed uploads step AdamW over every tensor, as a plain
    step does, and stage each stepped master narrowed to bf16 (the last two are left in the
    two buffers)."""
    import host_adam_dma  # pylint: disable=import-outside-toplevel

    runs = []

    def narrowed(adam):
        runs.append(host_adam_dma.narrowed_uploads(adam, down=False))
        runs[0]()

    adam, _ = _stepped_plainly_and_by(narrowed)
    assert torch.equal(runs[0].staged[0], adam.params[2].to(torch.bfloat16))
    assert torch.equal(runs[0].staged[1], adam.params[1].to(torch.bfloat16))


def test_the_widening_benchmark_steps_chunks_exactly_as_the_whole_tensors():
    """``host_adam_dma.py`` compares AdamW over bf16 gradients widened chunk by chunk with AdamW
    over the same gradients in fp32: the same work, element for element."""
    import host_adam_dma  # pylint: disable=import-outside-toplevel

    chunked, before = _stepped_plainly_and_by(
        lambda adam: host_adam_dma.widened_in_chunks(adam, tensors=3, chunk=1024)()
    )
    assert not torch.equal(chunked.params[0], before)  # the steps did step


def test_the_copies_benchmark_times_adamw_at_each_thread_count_and_can_skip_the_rest():
    """``host_adam_dma.py --threads 1 2 --beside-only`` times AdamW alone at both counts, in
    the given order, leaves torch's own count as it found it, and skips the host narrowing and
    widening."""
    import host_adam_dma  # pylint: disable=import-outside-toplevel

    default = torch.get_num_threads()
    seen = []
    real = host_adam_dma.HostAdam.step_all

    def noting(adam):
        seen.append(torch.get_num_threads())
        real(adam)

    args = ["--tensors", "2", "--numel", "1024", "--repeats", "1", "--threads", "1", "2"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(host_adam_dma.HostAdam, "step_all", noting)
        results = host_adam_dma.main(args + ["--beside-only"])
    assert torch.get_num_threads() == default
    assert seen == [1, 1, 2, 2]  # an untimed call and one timed, per count
    assert [label for label in results if label.startswith("adam alone")] == [
        "adam alone, 2 tensors, 1 threads",
        "adam alone, 2 tensors, 2 threads",
    ]
    assert not any("narrowed" in label or "widened" in label for label in results)
    assert any("widened" in label for label in host_adam_dma.main(args[:6]))


def _bench_row(implementation, case="gpt", fraction=0.5, step=0.1, ratio=1.0, limit=1.1):
    """A row as ``hdo_step.py`` writes it, with the fields the table reads."""
    return {
        "implementation": implementation,
        "case": case,
        "fraction": fraction,
        "overlap": True,
        "step_s": step,
        "step_min_s": step * 0.9,
        "step_max_s": step * 1.1,
        "pinned_held_mib": 64.0,
        "floor_s": step / ratio,
        "limit_s": step / limit,
        "ratio": ratio,
        "ratio_limit": limit,
        "ratio_paired": 1.2,
        "ratio_fp32_contended": None,
    }


def test_the_table_sets_each_fork_row_beside_upstream_s_and_bolds_only_both_bounds_met(
    tmp_path, capsys
):
    """``hdo_step_table.py`` pairs each fork row with upstream's row of the same case and
    fraction, prints the run's own floor and limit, and bolds a step only within 1.3x of the
    floor and 1.15x of the limit; ``-`` where a ratio or upstream's row was not measured."""
    import hdo_step_table  # pylint: disable=import-outside-toplevel

    rows = [
        _bench_row("upstream 0.19.2", fraction=1.0, step=0.5, ratio=2.5, limit=3.5),
        _bench_row("fork", fraction=1.0, step=0.2, ratio=1.0, limit=1.15),
        _bench_row("fork", fraction=0.5, step=0.1, ratio=0.9, limit=1.16),
        _bench_row("fork@.ab/main", case="moe", step=0.1, ratio=1.31, limit=1.0),
    ]
    path = tmp_path / "hdo_step_cuda.json"
    path.write_text(json.dumps({"device": "test", "rows": rows}))

    assert hdo_step_table.main([str(path), "--run", "R", "--no-header"]) == 0
    within, past_limit = capsys.readouterr().out.strip().splitlines()
    assert within == (
        "| gpt | 1.0 | R | 0.500 (0.450-0.550), 64.0 | 0.200 / 0.174 "
        "| **0.200** (0.180-0.220), 64.0 | 1.00x | 1.15x | 1.20x | - |"
    )
    assert past_limit.startswith("| gpt | 0.5 | R | - | 0.111 / 0.086 | 0.100 (")
    assert hdo_step_table.main([str(path), "--implementation", "fork@.ab/main"]) == 0
    header, rule, past_floor = capsys.readouterr().out.strip().splitlines()
    assert header.startswith("| case |") and rule.startswith("|---|")
    assert "| 0.100 (0.090-0.110), 64.0 | 1.31x | 1.00x |" in past_floor
    rows[1]["overlap"] = False  # no longer upstream's pair, and said so
    path.write_text(json.dumps({"device": "test", "rows": rows}))
    assert hdo_step_table.main([str(path), "--run", "R", "--no-header"]) == 0
    assert capsys.readouterr().out.startswith("| gpt | 1.0 | R, overlap off | - |")
    assert hdo_step_table.main([str(path), "--implementation", "fork parts"]) == 1
