# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The in-place step over runs of adjacent fp32 clones (hybrid_optimizer_flat_in_place).

Transformer Engine's FusedAdam, as Megatron's factory hands it to the HDO, steps the fp32
clones of the in-place parameters; the HDO hands it runs of clones laid out back to back, with
their moments laid out alike, instead of one tensor each. These tests compare that with TE stepping
the same clones one by one (``flat_in_place_steps = False``), bit for bit, through client
moves of the state and a checkpoint.
"""

import gc
import io

import pytest
import torch

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer_flat_in_place as flat_in_place
from megatron.core.optimizer.cpu_offloading import hybrid_optimizer_kernels as kernels
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import adjacent_runs

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

_optimizer_doubles = optimizer_table.sibling("optimizer_doubles")
GroupStepAdamW = _optimizer_doubles.GroupStepAdamW
counting_id_audits = _optimizer_doubles.counting_id_audits
te_fused_adam = _optimizer_doubles.te_fused_adam

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Sizes that are and are not multiples of a vector or a cache line, in two groups.
NUMELS = [4096, 1000, 77, 65536, 3, 12288, 513, 2048, 40000, 5]


FusedAdam = te_fused_adam()


@pytest.fixture(params=["te", "group_step_double"])
def in_place_cls(request, monkeypatch):
    """The in-place optimizer: TE's FusedAdam (on CUDA), or, anywhere, the test double that keeps
    TE's bookkeeping (a step per group, moments per parameter), registered for the flat step."""
    if request.param == "te":
        if FusedAdam is None or not torch.cuda.is_available():
            pytest.skip("needs Transformer Engine and CUDA")
        return FusedAdam
    identity = (GroupStepAdamW.__module__, GroupStepAdamW.__qualname__)
    monkeypatch.setattr(
        flat_in_place, "FLAT_STEPPED_CLASSES", flat_in_place.FLAT_STEPPED_CLASSES | {identity}
    )
    return GroupStepAdamW


class PerTensorHDO(HybridDeviceOptimizer):
    """The reference: the in-place optimizer steps its tensors one by one."""

    flat_in_place_steps = False


def make_params(seed=0, fp32=(), numels=NUMELS):
    """bf16 parameters of ``numels`` sizes, but fp32 at the indices ``fp32`` (stepped in place
    as they are, between clones)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(
            torch.randn(n, generator=generator).to(
                DEVICE, torch.float32 if index in fp32 else torch.bfloat16
            )
        )
        for index, n in enumerate(numels)
    ]


def make_hdo(cls, params, gpu_cls, fraction=0.5, **options):
    """An HDO of class ``cls`` over ``params`` in two groups, as Megatron's factory configures
    it, with ``gpu_cls`` in place (``options``: more settings for both sides)."""
    groups = [
        {"params": params[:6], "weight_decay": 0.01},
        {"params": params[6:], "weight_decay": 0.0},
    ]
    return cls(
        groups,
        offload_fraction=fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=gpu_cls,
        param_update_in_fp32=True,
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        **options,
    )


def in_place_clones(hdo):
    """``(parameter, fp32 clone)`` for each parameter whose fp32 clone is stepped in place (not
    on a host copy), in parameter order."""
    return [
        (param, clone)
        for param, clone in hdo.param_to_fp32_param.items()
        if param not in hdo.gpu_params_map_cpu_copy
    ]


def flat_and_reference(in_place_cls, fp32=()):
    """An HDO that steps in place over runs and its per-tensor reference, each with its own
    parameters of the same values: ``(hdo, params), (reference, ref_params)``."""
    params, ref_params = make_params(fp32=fp32), make_params(fp32=fp32)
    return (
        (make_hdo(HybridDeviceOptimizer, params, in_place_cls), params),
        (make_hdo(PerTensorHDO, ref_params, in_place_cls), ref_params),
    )


def give_grads(generator, *param_lists):
    """The same drawn gradients to each list of parameters (the optimizer and its reference)."""
    state = generator.get_state()
    for params in param_lists:
        generator.set_state(state)
        for param in params:
            param.grad = torch.randn(param.numel(), generator=generator).to(DEVICE, param.dtype)


def steps_with_a_gradient_missing(generator, params, ref_params, missing, steps=4):
    """Gives both sides the same gradients before each of ``steps`` steps, whose number it
    yields, but none to the parameter at index ``missing`` before step 2."""
    for step in range(steps):
        give_grads(generator, params, ref_params)
        if step == 2:
            params[missing].grad = ref_params[missing].grad = None
        yield step


def count_walked(monkeypatch, cls):
    """A list that gets, for each call of ``cls.step``, the tensors its groups hold."""
    walked = []
    original = cls.step

    def spy(self, *args, **kwargs):
        walked.append(sum(len(group["params"]) for group in self.param_groups))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "step", spy)
    return walked


def moments(hdo, params):
    """The moments of the parameters stepped in place."""
    return [
        [hdo.state[p][key] for key in ("exp_avg", "exp_avg_sq")]
        for p in params
        if p not in hdo.gpu_params_map_cpu_copy
    ]


MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def reassign_moments(optimizers, move):
    """As a client does between training phases: every moment of every entry replaced by
    ``move(entry, moment)``."""
    for optimizer in optimizers:
        for entry in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = move(entry, entry[key])


def assert_moments_laid_out(optimizer):
    """Each run of adjacent in-place tensors has its moments back to back, key by key."""
    for group in optimizer.param_groups:
        params = group["params"]
        for first, count, _ in adjacent_runs(params):
            for key in ("exp_avg", "exp_avg_sq"):
                values = [optimizer.state[p][key] for p in params[first : first + count]]
                for before, after in zip(values, values[1:]):
                    assert after.data_ptr() == before.data_ptr() + before.nbytes, key


def assert_same(hdo, reference, params, ref_params):
    """Parameters, in-place moments, inner copies and group steps equal bit for bit."""
    for index, (a, b) in enumerate(zip(params, ref_params)):
        assert torch.equal(a, b), f"parameter {index} differs"
    for index, (mine, theirs) in enumerate(
        zip(moments(hdo, params), moments(reference, ref_params))
    ):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b), f"a moment of in-place parameter {index} differs"
    for a, b in zip(hdo.param_to_inner_param.values(), reference.param_to_inner_param.values()):
        assert torch.equal(a, b)
    steps = [g.get("step") for g in hdo.gpu_optimizer.param_groups]
    assert steps == [g.get("step") for g in reference.gpu_optimizer.param_groups]


def step_both_over_runs(walked, generator, ours, theirs, steps):
    """``steps`` steps of both (HDO, parameters) pairs on the same gradients: ours takes two runs
    each time, and both stay equal."""
    (hdo, params), (reference, ref_params) = ours, theirs
    for _ in range(steps):
        give_grads(generator, params, ref_params)
        walked.clear()
        hdo.step()
        assert walked == [2], walked
        reference.step()
        assert_same(hdo, reference, params, ref_params)


def test_in_place_fp32_clones_lie_back_to_back_in_parameter_order():
    """The layout the flat step takes runs from: each in-place clone starts where the one
    before it ends, in one storage, and holds its parameter's values widened."""
    params = make_params()
    hdo = make_hdo(HybridDeviceOptimizer, params, torch.optim.AdamW)
    clones = [clone for _, clone in in_place_clones(hdo)]
    assert len(clones) > 2
    storage = clones[0].untyped_storage().data_ptr()
    for before, after in zip(clones, clones[1:]):
        assert after.data_ptr() == before.data_ptr() + before.nbytes
        assert after.untyped_storage().data_ptr() == storage
    for param, clone in in_place_clones(hdo):
        assert clone.dtype == torch.float32 and torch.equal(clone, param.detach().float())


def test_runs_are_adjacent_fp32_tensors_of_one_storage_up_to_the_cap():
    """A run goes on while the next tensor starts where the last ended, in the same storage,
    dense fp32, and the run stays within ``most`` elements (a larger tensor is a run alone)."""
    block, other = torch.zeros(200), torch.zeros(7)
    tensors = [block[0:10], block[10:30], block[30:60], other, block[60:100], block[100:200]]
    assert adjacent_runs(tensors, most=40) == [
        (0, 2, 30),  # the third would make 60
        (2, 1, 30),
        (3, 1, 7),  # another storage
        (4, 1, 40),  # after another storage: not adjacent to what came before it
        (5, 1, 100),  # larger than the cap: alone
    ]
    assert adjacent_runs(tensors[:3], most=100) == [(0, 3, 60)]
    halves = torch.zeros(40, dtype=torch.bfloat16)
    assert adjacent_runs([halves[:20], halves[20:]]) == [(0, 1, 20), (1, 1, 20)]  # not fp32
    grid = torch.zeros(4, 4)
    assert adjacent_runs([grid[:2], grid[2:]]) == [(0, 2, 16)]
    assert adjacent_runs([grid[:, :2], grid[:, 2:]]) == [(0, 1, 8), (1, 1, 8)]  # not dense


@pytest.mark.parametrize(
    "fp32, cap, runs",
    [((), None, 2), ((8,), None, 4), ((), 4096, 5)],
    ids=[
        "clones only: gradients widened into one buffer",
        "an fp32 parameter between clones",
        "runs capped at 4096 elements",
    ],
)
def test_te_fused_adam_steps_runs_of_clones_exactly_and_walks_them_once(
    monkeypatch, in_place_cls, fp32, cap, runs
):
    """From the first step on TE's own step sees a handful of runs, not the in-place tensors
    one by one (one run per group of adjacent clones; an fp32 parameter stepped as it is parts
    them, and so does the cap on a run's size): the first step creates the moments laid out.
    Every parameter, moment and group step equals TE stepping them one by one."""
    if cap is not None:
        monkeypatch.setattr(kernels, "RUN_NUMEL", cap)
    walked = count_walked(monkeypatch, in_place_cls)
    (hdo, params), (reference, ref_params) = flat_and_reference(in_place_cls, fp32=fp32)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        give_grads(generator, params, ref_params)
        walked.clear()
        hdo.step()
        assert walked == [runs], (step, walked)
        assert_moments_laid_out(hdo.gpu_optimizer)
        reference.step()
        assert_same(hdo, reference, params, ref_params)


def test_a_step_over_runs_finds_the_state_without_an_id_per_tensor(monkeypatch, in_place_cls):
    """Each step looks up the in-place tensors' entries; a dict lookup by tensor calls ``id``,
    whose audit event runs every installed audit hook in Python (filelock installs one), which
    on thousands of shards in place costs milliseconds a step. The in-place step's lookups are
    per run, not per tensor: the optimizer's own over the run (as many as its step makes for a
    tensor, which the per-tensor reference shows: one for torch-like steps, more for TE's, which
    looks each moment up again to unscale it) and one for the stand-in's state. Still exact."""
    with counting_id_audits() as calibration:
        hash(torch.zeros(1))
    assert calibration["count"] == 1  # a tensor's hash is one ``id``: what is counted below
    walked = count_walked(monkeypatch, in_place_cls)
    ours, theirs = flat_and_reference(in_place_cls)
    generator = torch.Generator().manual_seed(11)
    step_both_over_runs(walked, generator, ours, theirs, 2)
    (hdo, params), (reference, ref_params) = ours, theirs
    in_place = sum(len(group["params"]) for group in hdo.gpu_optimizer.param_groups)
    counted = []

    def counting(step_in_place):
        def counting_step():
            with counting_id_audits() as audits:
                step_in_place()
            counted.append(audits["count"])

        return counting_step

    for optimizer in (hdo, reference):
        monkeypatch.setattr(
            optimizer, "_step_in_place_whole", counting(optimizer._step_in_place_whole)
        )
    give_grads(generator, params, ref_params)
    walked.clear()
    hdo.step()
    reference.step()
    assert walked == [2, in_place], walked
    ours, per_tensor = counted
    own = per_tensor / in_place  # the optimizer's own lookups for one tensor
    assert own >= 1 and ours <= (own + 1) * walked[0] < per_tensor, (counted, in_place)
    assert_same(hdo, reference, params, ref_params)


def test_te_state_moved_away_and_back_by_a_client_still_steps_exactly(monkeypatch, in_place_cls):
    """megatron-core's ``offload_to_cpu`` / ``restore_from_cpu`` between steps: the moments go to
    the host and come back as new tensors one by one; the next step lays them out and takes
    runs (no walk of TE's), all exact."""
    walked = count_walked(monkeypatch, in_place_cls)
    ours, theirs = flat_and_reference(in_place_cls)
    generator = torch.Generator().manual_seed(2)
    step_both_over_runs(walked, generator, ours, theirs, 2)
    for _ in range(2):
        optimizers = (ours[0], theirs[0])
        reassign_moments(optimizers, lambda entry, value: value.to("cpu", copy=True))
        reassign_moments(optimizers, lambda entry, value: value.to(entry.inner.device, copy=True))
        step_both_over_runs(walked, generator, ours, theirs, 1)
    step_both_over_runs(walked, generator, ours, theirs, 1)
    hdo = ours[0]
    # After the last move the moments were laid out again.
    assert_moments_laid_out(hdo.gpu_optimizer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="parks the state on the host")
@pytest.mark.parametrize("taken_home_by", ["_move_new_state_to_right_device", "the next step"])
def test_te_state_parked_on_the_host_comes_home_laid_out(monkeypatch, in_place_cls, taken_home_by):
    """verl's and slime's offload between training and rollout: every moment goes to the host
    by ``.to("cpu", non_blocking=True)`` and is taken home by the HDO's
    ``_move_new_state_to_right_device()`` (or by the next step): into one block per run, so
    the step after takes runs, and all equal TE stepping the tensors one by one."""
    walked = count_walked(monkeypatch, in_place_cls)
    ours, theirs = flat_and_reference(in_place_cls)
    hdo, reference = ours[0], theirs[0]
    generator = torch.Generator().manual_seed(8)
    step_both_over_runs(walked, generator, ours, theirs, 2)
    reassign_moments((hdo, reference), lambda _, value: value.to("cpu", non_blocking=True))
    torch.cuda.synchronize()
    assert all(
        hdo.gpu_optimizer.state[clone][key].device.type == "cpu"
        for group in hdo.gpu_optimizer.param_groups
        for clone in group["params"]
        for key in MOMENT_KEYS
    )
    if taken_home_by != "the next step":
        for optimizer in (hdo, reference):
            getattr(optimizer, taken_home_by)()
        assert_moments_laid_out(hdo.gpu_optimizer)
    step_both_over_runs(walked, generator, ours, theirs, 2)
    assert_moments_laid_out(hdo.gpu_optimizer)


@pytest.mark.parametrize("read_to", ["cpu", DEVICE], ids=["read to the host", "read to the device"])
def test_te_checkpoint_of_a_flat_stepped_hdo_resumes_exactly(monkeypatch, in_place_cls, read_to):
    """A state dict written after flat steps loads into a new HDO, whose steps equal the
    per-tensor optimizer's from the same checkpoint, taking runs from the first. Moments read to
    the host land laid out on the device; moments already on the device are adopted as they
    are (a block beside them would hold them twice while the caller keeps them), and the first
    step lays them out before it takes runs."""
    walked = count_walked(monkeypatch, in_place_cls)
    params = make_params()
    hdo = make_hdo(HybridDeviceOptimizer, params, in_place_cls)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        give_grads(generator, params)
        hdo.step()
    saved = hdo.state_dict()
    # One tensor each, as a distributed checkpoint hands them over (torch.save alone would keep
    # the views into one block).
    saved["state"] = {
        key: {
            name: value.clone() if torch.is_tensor(value) else value
            for name, value in entry.items()
        }
        for key, entry in saved["state"].items()
    }
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    resumed = []
    for cls in (HybridDeviceOptimizer, PerTensorHDO):
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        optimizer = make_hdo(cls, copies, in_place_cls)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False, map_location=read_to)
        optimizer.load_state_dict(loaded)
        resumed.append((optimizer, copies, loaded))
    (flat, flat_params, loaded), (reference, ref_params, _) = resumed
    loaded_ptrs = {v.data_ptr() for e in loaded["state"].values() for v in e.values()}
    in_place = [
        flat.gpu_optimizer.state[c] for g in flat.gpu_optimizer.param_groups for c in g["params"]
    ]
    adopted = [entry[key].data_ptr() in loaded_ptrs for entry in in_place for key in MOMENT_KEYS]
    if read_to == DEVICE:
        assert all(adopted)
    else:
        assert not any(adopted)
        assert_moments_laid_out(flat.gpu_optimizer)
    step_both_over_runs(walked, generator, (flat, flat_params), (reference, ref_params), 3)


def test_a_step_where_an_in_place_parameter_has_no_gradient_is_the_optimizer_s_own(
    monkeypatch, in_place_cls
):
    """TE skips a parameter without a gradient, which a run cannot: that step is TE's walk, the
    others take runs, and all equal TE stepping the tensors one by one."""
    walked = count_walked(monkeypatch, in_place_cls)
    (hdo, params), (reference, ref_params) = flat_and_reference(in_place_cls)
    generator = torch.Generator().manual_seed(4)
    frozen = len(NUMELS) - 2  # in place, in the second group
    for step in steps_with_a_gradient_missing(generator, params, ref_params, frozen):
        walked.clear()
        hdo.step()
        in_place = sum(len(group["params"]) for group in hdo.gpu_optimizer.param_groups)
        assert walked == ([in_place] if step == 2 else [2]), (step, walked)
        reference.step()
        assert_same(hdo, reference, params, ref_params)


def test_dummy_step_creates_te_s_zero_moments_laid_out(monkeypatch, in_place_cls):
    """The distributed optimizer's scaffold materialises state by ``dummy_step`` before a load
    fills it in place: the in-place moments are then TE's (zero fp32, every parameter, no
    step counted) but laid out, so the first step takes runs and moves nothing."""
    walked = count_walked(monkeypatch, in_place_cls)
    (hdo, params), (reference, ref_params) = flat_and_reference(in_place_cls)
    hdo.dummy_step()
    reference.dummy_step()
    assert_moments_laid_out(hdo.gpu_optimizer)
    ours, theirs = hdo.gpu_optimizer, reference.gpu_optimizer
    for group, ref_group in zip(ours.param_groups, theirs.param_groups):
        assert group.get("step") == ref_group.get("step")
        for clone, ref_clone in zip(group["params"], ref_group["params"]):
            mine, expected = ours.state[clone], theirs.state[ref_clone]
            assert list(mine) == list(expected)
            for key in expected:
                assert mine[key].dtype == expected[key].dtype == torch.float32
                assert mine[key].shape == expected[key].shape
                assert torch.equal(mine[key], expected[key])
    generator = torch.Generator().manual_seed(5)
    step_both_over_runs(walked, generator, (hdo, params), (reference, ref_params), 2)


def test_n_dimensional_in_place_parameters_step_over_runs_exactly(monkeypatch, in_place_cls):
    """Matrices stepped in place (an HDO over a model's own parameters, no distributed
    optimizer): their gradients are flattened into the widened buffer and the runs still
    equal TE stepping each matrix."""
    walked = count_walked(monkeypatch, in_place_cls)
    shapes = [(64, 32), (7, 5), (128,), (3, 4, 5), (256, 16)]

    def matrices(seed):
        generator = torch.Generator().manual_seed(seed)
        return [
            torch.nn.Parameter(torch.randn(shape, generator=generator).to(DEVICE, torch.bfloat16))
            for shape in shapes
        ]

    params, ref_params = matrices(0), matrices(0)
    hdo = make_hdo(HybridDeviceOptimizer, params, in_place_cls, fraction=0.0)
    reference = make_hdo(PerTensorHDO, ref_params, in_place_cls, fraction=0.0)
    generator = torch.Generator().manual_seed(6)
    for _ in range(3):
        state = generator.get_state()
        for group in (params, ref_params):
            generator.set_state(state)
            for param in group:
                param.grad = torch.randn(param.shape, generator=generator).to(DEVICE, param.dtype)
        walked.clear()
        hdo.step()
        assert walked == [1], walked  # one run: the five matrices, all in the first group
        reference.step()
        assert_same(hdo, reference, params, ref_params)


@pytest.mark.skipif(
    FusedAdam is None or not torch.cuda.is_available(), reason="needs Transformer Engine and CUDA"
)
def test_first_step_holds_each_moment_once_on_the_gpu():
    """The first step's peak GPU memory is the widened gradients and TE's moments, each held
    once: creating the moments one by one and then laying them out would hold a run's block of
    one moment on top of that (TE's kernel itself allocates nothing of a tensor's size)."""
    # Two groups (``make_hdo`` parts them after six), one run each: about 4M and 2M elements.
    numels = [1 << 20] * 3 + [3000, 1 << 19, 1 << 19] + [1 << 20] * 2
    generator = torch.Generator().manual_seed(7)
    params = [
        torch.nn.Parameter(torch.randn(n, generator=generator).to("cuda", torch.bfloat16))
        for n in numels
    ]
    hdo = make_hdo(HybridDeviceOptimizer, params, FusedAdam, fraction=0.0)
    hdo._init_sub_optimizers()  # pylint: disable=protected-access
    for param in params:
        param.grad = torch.randn(param.numel(), generator=generator).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    hdo.step()
    torch.cuda.synchronize()
    in_place = sum(numels)
    moments, widened = 8 * in_place, 4 * in_place
    slack = 1 << 20
    # The slack (1 MiB) is less than the smaller run's block of one moment (8 MiB).
    assert torch.cuda.max_memory_allocated() - before <= moments + widened + slack


def _shared_within_a_group(optimizer):
    """The largest and the smallest tensor of the first group, and the moment they share."""
    return (*larger_then_smaller(optimizer), "exp_avg")


def _shared_across_groups(optimizer):
    """The first group's largest tensor, the second group's smallest, and the moment they
    share."""
    second = min(optimizer.gpu_optimizer.param_groups[1]["params"], key=torch.numel)
    return larger_then_smaller(optimizer)[0], second, "exp_avg_sq"


@pytest.mark.parametrize("pair", [_shared_within_a_group, _shared_across_groups])
def test_moments_a_client_made_share_memory_stay_shared_and_step_exactly(in_place_cls, pair):
    """A client that makes one in-place moment a view of another's (in one group or across
    two): TE steps the shared memory as shared, so the HDO leaves such moments to TE's walk
    rather than parting them into blocks, and every step equals TE stepping the tensors one by
    one."""
    (hdo, params), (reference, ref_params) = flat_and_reference(in_place_cls)
    generator = torch.Generator().manual_seed(9)
    for step in range(4):
        give_grads(generator, params, ref_params)
        if step == 2:
            for optimizer in (hdo, reference):
                first, second, key = pair(optimizer)
                state = optimizer.gpu_optimizer.state
                state[second][key] = state[first][key].view(-1)[: second.numel()]
        hdo.step()
        reference.step()
        assert_same(hdo, reference, params, ref_params)
    first, second, key = pair(hdo)
    state = hdo.gpu_optimizer.state
    assert state[second][key].data_ptr() == state[first][key].data_ptr()


def larger_then_smaller(hdo):
    """The largest and the smallest tensor of the in-place optimizer's first group."""
    tensors = sorted(hdo.gpu_optimizer.param_groups[0]["params"], key=torch.Tensor.numel)
    return tensors[-1], tensors[0]


# ------------------------------------------------------------ torch's fused Adam and AdamW


def fused_and_reference(gpu_cls, numels=NUMELS, **options):
    """An HDO with torch's fused ``gpu_cls`` in place (fused on both sides, as Megatron's
    factory sets it) and its reference, which leaves that step to torch: ``(hdo, params),
    (reference, ref_params)``."""
    params, ref_params = make_params(numels=numels), make_params(numels=numels)
    options = dict(fused=True, **options)
    return (
        (make_hdo(HybridDeviceOptimizer, params, gpu_cls, **options), params),
        (make_hdo(PerTensorHDO, ref_params, gpu_cls, **options), ref_params),
    )


def count_torch_walks(monkeypatch):
    """A list that gets, for each walk torch's Adam step takes over its parameters
    (``_init_group``), the optimizer walked."""
    walks = []
    for cls in (torch.optim.Adam, torch.optim.AdamW):  # each may hold its own by now
        original = cls._init_group  # pylint: disable=protected-access

        def spy(self, *args, original=original, **kwargs):
            walks.append(self)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "_init_group", spy)
    return walks


def in_place_indices(hdo, params):
    """Indices of the parameters stepped in place."""
    return [i for i, p in enumerate(params) if p not in hdo.gpu_params_map_cpu_copy]


def assert_same_state(hdo, reference, params, ref_params, skip=()):
    """Parameters and every state entry (counters, moments, masters) equal bit for bit, but
    for the parameters at the indices in ``skip``."""
    for index, (a, b) in enumerate(zip(params, ref_params)):
        if index in skip:
            continue
        assert torch.equal(a, b), f"parameter {index} differs"
        mine, theirs = hdo.state[a], reference.state[b]
        assert sorted(mine) == sorted(theirs), index
        for key, value in theirs.items():
            assert torch.equal(mine[key], value), f"{key} of parameter {index} differs"


def step_both(generator, hdo, reference, params, ref_params, lr=None):
    """One step of both on the same gradients (and learning rate, if given)."""
    give_grads(generator, params, ref_params)
    if lr is not None:
        for optimizer in (hdo, reference):
            for group in optimizer.param_groups:
                group["lr"] = lr
    hdo.step()
    reference.step()


@pytest.mark.parametrize(
    "gpu_cls, options",
    [
        (torch.optim.AdamW, {}),
        (torch.optim.Adam, {}),
        (torch.optim.Adam, {"decoupled_weight_decay": True}),
        (torch.optim.AdamW, {"maximize": True}),
    ],
    ids=["adamw", "adam", "adam-decoupled", "adamw-maximize"],
)
def test_torch_fused_adam_in_place_is_its_kernel_over_the_clones_from_the_first_step(
    gpu_cls, options, monkeypatch
):
    """From the first step (which makes the state torch would make), the in-place share is
    stepped without torch's walk over it, by its kernel over the clones, to the same bits,
    with the learning rate of the moment."""
    walks = count_torch_walks(monkeypatch)
    (hdo, params), (reference, ref_params) = fused_and_reference(gpu_cls, **options)
    generator = torch.Generator().manual_seed(5)
    for step in range(4):
        walks.clear()
        step_both(generator, hdo, reference, params, ref_params, lr=1e-3 * 0.5**step)
        assert hdo.gpu_optimizer not in walks, step
        assert reference.gpu_optimizer in walks
        assert_same_state(hdo, reference, params, ref_params)


def test_torch_fused_adamw_steps_the_state_a_client_put_in_place(monkeypatch):
    """Moments a client replaces with tensors of its own (on the parameters' device) are the
    ones the kernel steps, without torch's walk."""
    walks = count_torch_walks(monkeypatch)
    (hdo, params), (reference, ref_params) = fused_and_reference(torch.optim.AdamW)
    generator = torch.Generator().manual_seed(6)
    in_place = in_place_indices(hdo, params)
    for _ in range(2):
        step_both(generator, hdo, reference, params, ref_params)
    for optimizer, tensors in ((hdo, params), (reference, ref_params)):
        for index in in_place:
            entry = optimizer.state[tensors[index]]
            entry["exp_avg"] = entry["exp_avg"].clone()
    held = [hdo.state[params[i]]["exp_avg"] for i in in_place]
    before = [value.clone() for value in held]
    walks.clear()
    step_both(generator, hdo, reference, params, ref_params)
    assert hdo.gpu_optimizer not in walks
    assert_same_state(hdo, reference, params, ref_params)
    for index, value, old in zip(in_place, held, before):
        assert hdo.state[params[index]]["exp_avg"] is value
        assert not torch.equal(value, old)  # stepped where the client put it


@pytest.mark.parametrize("setting", ["amsgrad", "not-fused", "class-patched"])
def test_torch_adamw_in_place_steps_itself_where_its_kernel_call_would_differ(setting, monkeypatch):
    """amsgrad, no fused kernel, or a step patched on the class: torch's own step runs."""
    walks = count_torch_walks(monkeypatch)
    options = {"amsgrad": {"amsgrad": True}, "not-fused": {"fused": False}}.get(setting, {})
    params = make_params()
    hdo = make_hdo(HybridDeviceOptimizer, params, torch.optim.AdamW, **{"fused": True, **options})
    patched = []
    if setting == "class-patched":
        original = torch.optim.AdamW.step

        def patched_step(self, *args, **kwargs):
            patched.append(self)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.optim.AdamW, "step", patched_step)
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        give_grads(generator, params)
        walks.clear()
        hdo.step()
        assert hdo.gpu_optimizer in walks
    if setting == "class-patched":
        assert patched.count(hdo.gpu_optimizer) == 3


def test_step_hooks_of_torch_fused_adamw_in_place_run_on_every_step():
    """A step hook on the in-place optimizer sees every step, so torch's step runs it."""
    params = make_params()
    hdo = make_hdo(HybridDeviceOptimizer, params, torch.optim.AdamW, fused=True)
    seen = []
    hdo.gpu_optimizer.register_step_post_hook(lambda optimizer, *_: seen.append(optimizer))
    generator = torch.Generator().manual_seed(8)
    for _ in range(3):
        give_grads(generator, params)
        hdo.step()
    assert seen == [hdo.gpu_optimizer] * 3


def test_a_counter_seen_as_another_dtype_in_place_is_torch_s_to_refuse():
    """A counter whose ``.data`` a client made an int32 view of the same memory (same object,
    same address) is not stepped as fp32: torch's step refuses the state, and no counter moves."""
    params = make_params()
    hdo = make_hdo(HybridDeviceOptimizer, params, torch.optim.AdamW, fused=True)
    generator = torch.Generator().manual_seed(9)
    for _ in range(2):
        give_grads(generator, params)
        hdo.step()
    in_place = in_place_indices(hdo, params)
    counters = [hdo.state[params[i]]["step"] for i in in_place]
    counters[0].data = counters[0].data.view(torch.int32)
    give_grads(generator, params)
    with pytest.raises(RuntimeError):
        hdo.step()
    assert all(float(c.view(torch.float32)) == 2.0 for c in counters)


def test_a_clone_moved_to_the_next_in_place_group_takes_that_group_s_gradients_and_settings():
    """The last clone of one in-place group moved to the front of the next (the tensors keep
    their order): each group's kernel call gets its own gradients, as torch's step would."""
    (hdo, params), (reference, ref_params) = fused_and_reference(torch.optim.AdamW)
    generator = torch.Generator().manual_seed(10)
    for _ in range(2):
        step_both(generator, hdo, reference, params, ref_params)
    for optimizer in (hdo, reference):
        first, second = optimizer.gpu_optimizer.param_groups
        assert len(first["params"]) > 1 and first["weight_decay"] != second["weight_decay"]
        second["params"].insert(0, first["params"].pop())
    for _ in range(2):
        step_both(generator, hdo, reference, params, ref_params)
        assert_same_state(hdo, reference, params, ref_params)


def test_a_step_with_an_in_place_gradient_missing_is_torch_s_and_the_next_is_the_kernel_s(
    monkeypatch,
):
    """A step where an in-place clone has no gradient is torch's own (which skips that clone);
    the next step with every gradient is the kernel's again, to the same bits."""
    walks = count_torch_walks(monkeypatch)
    (hdo, params), (reference, ref_params) = fused_and_reference(torch.optim.AdamW)
    generator = torch.Generator().manual_seed(11)
    missing = in_place_indices(hdo, params)[1]
    for step in steps_with_a_gradient_missing(generator, params, ref_params, missing):
        walks.clear()
        hdo.step()
        reference.step()
        assert (hdo.gpu_optimizer in walks) == (step == 2), step
        assert_same_state(hdo, reference, params, ref_params)


def test_a_loaded_checkpoint_is_stepped_by_the_kernel_from_its_first_step(monkeypatch):
    """State loaded into a fresh optimizer is torch's fused state (counters on the clones'
    device, fp32 moments), so the first step after the load is the kernel's, and it goes on as
    the run that was not interrupted."""
    walks = count_torch_walks(monkeypatch)
    (hdo, params), (reference, ref_params) = fused_and_reference(torch.optim.AdamW)
    generator = torch.Generator().manual_seed(12)
    for _ in range(2):
        step_both(generator, hdo, reference, params, ref_params)
    buffer = io.BytesIO()
    torch.save(hdo.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = make_params(seed=3)
    with torch.no_grad():
        for resumed, param in zip(resumed_params, params):
            resumed.copy_(param)
    resumed = make_hdo(HybridDeviceOptimizer, resumed_params, torch.optim.AdamW, fused=True)
    resumed.load_state_dict(torch.load(buffer))
    for _ in range(2):
        state = generator.get_state()
        give_grads(generator, resumed_params)
        generator.set_state(state)
        walks.clear()
        step_both(generator, hdo, reference, params, ref_params)
        resumed.step()
        assert resumed.gpu_optimizer not in walks
        assert_same_state(resumed, reference, resumed_params, ref_params)


# Sizes that fill whole 64-byte lines, so that adjacent clones make one run: with a twentieth of
# the elements offloaded, clones 1-5 are the first group's in place, 6-7 the second's.
LINE_NUMELS = [1024, 2048, 512, 4096, 1024, 16, 3072, 1024]


def spy_in_place_kernel(monkeypatch, hdo):
    """A list that gets, for each call of torch's fused AdamW kernel on the HDO's in-place
    clones, the element count of each tensor it was handed."""
    calls = []
    original = torch._fused_adamw_  # pylint: disable=protected-access
    # The clones lie back to back in one block: its storage is theirs.
    block = in_place_clones(hdo)[0][1].untyped_storage().data_ptr()

    def spy(params, *args, **kwargs):
        if params and params[0].untyped_storage().data_ptr() == block:
            calls.append([param.numel() for param in params])
        return original(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    return calls


def test_torch_fused_adamw_in_place_takes_runs_of_clones_with_their_moments_laid_out(monkeypatch):
    """The first step makes the state torch would make with the moments in one block per run
    of clones and each group's counters the scalars of one vector, and from then on the kernel
    takes each run as one tensor, to the bits of torch stepping every clone alone; no moment
    moves."""
    (hdo, params), (reference, ref_params) = fused_and_reference(
        torch.optim.AdamW, numels=LINE_NUMELS, fraction=0.05
    )
    calls = spy_in_place_kernel(monkeypatch, hdo)
    generator = torch.Generator().manual_seed(13)
    step_both(generator, hdo, reference, params, ref_params)
    in_place = in_place_indices(hdo, params)
    assert in_place == list(range(1, 8))
    assert calls == [[sum(LINE_NUMELS[1:6])], [sum(LINE_NUMELS[6:])]]
    held = {i: [hdo.state[params[i]][key] for key in MOMENT_KEYS] for i in in_place}
    places = {i: [value.data_ptr() for value in values] for i, values in held.items()}
    for _ in range(3):
        calls.clear()
        step_both(generator, hdo, reference, params, ref_params)
        assert calls == [[sum(LINE_NUMELS[1:6])], [sum(LINE_NUMELS[6:])]]
        assert_same_state(hdo, reference, params, ref_params)
    assert_moments_laid_out(hdo.gpu_optimizer)
    for index, values in held.items():
        assert [hdo.state[params[index]][key] for key in MOMENT_KEYS] == values
        assert [value.data_ptr() for value in values] == places[index]
    for group in hdo.gpu_optimizer.param_groups:  # each group's counters: one vector's scalars
        counters = [hdo.gpu_optimizer.state[clone]["step"] for clone in group["params"]]
        assert len({c.untyped_storage().data_ptr() for c in counters}) == 1
        assert [c.data_ptr() - counters[0].data_ptr() for c in counters] == [
            4 * i for i in range(len(counters))
        ]


def test_a_run_ends_after_a_clone_that_does_not_fill_whole_lines(monkeypatch):
    """A clone whose size is not a whole number of 64-byte lines ends its run: the host
    kernel's scalar loop over a tensor's last partial vector may round otherwise than its
    vector loop, so that vector stays last, as in torch's own step."""
    numels = [1024, 2048, 517, 4096, 1024, 16, 3072, 1024]
    (hdo, params), (reference, ref_params) = fused_and_reference(
        torch.optim.AdamW, numels=numels, fraction=0.05
    )
    calls = spy_in_place_kernel(monkeypatch, hdo)
    generator = torch.Generator().manual_seed(14)
    for step in range(3):
        calls.clear()
        step_both(generator, hdo, reference, params, ref_params)
        if step:
            assert calls == [[2048 + 517, 4096 + 1024 + 16], [3072 + 1024]]
        assert_same_state(hdo, reference, params, ref_params)


@pytest.mark.parametrize("missing_at", [0, 2], ids=["first-step", "third-step"])
def test_a_clone_that_missed_a_step_keeps_its_own_count_inside_a_run(missing_at, monkeypatch):
    """A clone in the middle of a run whose gradient is missing for one step (torch's own
    step, which skips it) is one step behind its neighbours from then on: its run is cut
    around it, so each clone is stepped with its own count, as torch would. Where that step
    is the first, torch's step makes the others' state one by one, and the next step (which
    makes the missing one's) is torch's too; the moments are then laid out in runs."""
    walks = count_torch_walks(monkeypatch)
    (hdo, params), (reference, ref_params) = fused_and_reference(
        torch.optim.AdamW, numels=LINE_NUMELS, fraction=0.05
    )
    calls = spy_in_place_kernel(monkeypatch, hdo)
    generator = torch.Generator().manual_seed(15 + missing_at)
    walked = {missing_at, 1} if missing_at == 0 else {missing_at}
    for step in range(5):
        give_grads(generator, params, ref_params)
        if step == missing_at:
            params[3].grad = ref_params[3].grad = None
        walks.clear()
        calls.clear()
        hdo.step()
        reference.step()
        assert (hdo.gpu_optimizer in walks) == (step in walked), step
        if step > max(walked):
            assert calls == [[2048 + 512, 4096, 1024 + 16], [3072 + 1024]], calls
        assert_same_state(hdo, reference, params, ref_params)
    assert float(hdo.state[params[3]]["step"]) == float(hdo.state[params[2]]["step"]) - 1
    assert_moments_laid_out(hdo.gpu_optimizer)


def stepped_twice(monkeypatch, seed):
    """An HDO over ``LINE_NUMELS`` with torch's fused AdamW in place and its reference, after
    two steps on the same gradients: the walks' spy, the generator, and both pairs."""
    walks = count_torch_walks(monkeypatch)
    ours, theirs = fused_and_reference(torch.optim.AdamW, numels=LINE_NUMELS, fraction=0.05)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):
        step_both(generator, ours[0], theirs[0], ours[1], theirs[1])
    return walks, generator, ours, theirs


@pytest.mark.parametrize("write", ["in-place", "through-data"])
def test_a_counter_a_client_wrote_is_the_one_its_clone_is_stepped_with(write, monkeypatch):
    """A counter a client sets (the same tensor, another value; through ``.data`` too, which
    leaves no trace on the tensor) is read before the next kernel step, and its clone is
    stepped with it alone."""
    walks, generator, (hdo, params), (reference, ref_params) = stepped_twice(monkeypatch, 16)
    for optimizer, tensors in ((hdo, params), (reference, ref_params)):
        counter = optimizer.state[tensors[4]]["step"]
        (counter if write == "in-place" else counter.data).fill_(40.0)
    for _ in range(2):
        walks.clear()
        step_both(generator, hdo, reference, params, ref_params)
        assert hdo.gpu_optimizer not in walks
        assert_same_state(hdo, reference, params, ref_params)
    assert float(hdo.state[params[4]]["step"]) == 42.0


def test_a_counter_two_clones_share_leaves_the_step_to_torch(monkeypatch):
    """One counter tensor held by two clones' entries is stepped twice by torch's step, which
    no run can repeat: the step is torch's own, to the same bits, and the entries keep sharing
    the one counter."""
    walks, generator, (hdo, params), (reference, ref_params) = stepped_twice(monkeypatch, 18)
    for optimizer, tensors in ((hdo, params), (reference, ref_params)):
        optimizer.state[tensors[3]]["step"] = optimizer.state[tensors[1]]["step"]
    # On CUDA torch counts the shared counter in a kernel whose blocks race for it (it gains
    # one or two a step), so two torch steps agree on those two parameters only on the host.
    racing = {1, 3} if params[1].is_cuda else set()
    for _ in range(2):
        walks.clear()
        step_both(generator, hdo, reference, params, ref_params)
        assert hdo.gpu_optimizer in walks
        assert hdo.state[params[3]]["step"] is hdo.state[params[1]]["step"]
        assert_same_state(hdo, reference, params, ref_params, skip=racing)


def test_counters_a_client_replaced_are_freed_before_the_next_step(monkeypatch):
    """Once a client puts new counters in place of the vector the state was made with (moving
    the state away and back, say), the old one's memory is free: the kernel step keeps no view
    of it between steps."""
    _, _, (hdo, _), _ = stepped_twice(monkeypatch, 20)
    state = hdo.gpu_optimizer.state
    clones = [clone for group in hdo.gpu_optimizer.param_groups for clone in group["params"]]
    # pylint: disable=protected-access
    handles = [state[clone]["step"].untyped_storage()._weak_ref() for clone in clones]
    for clone in clones:
        state[clone]["step"] = state[clone]["step"].clone()
    gc.collect()
    freed = [torch.UntypedStorage._expired(handle) for handle in handles]
    for handle in handles:
        torch.UntypedStorage._free_weak_ref(handle)
    assert all(freed)
