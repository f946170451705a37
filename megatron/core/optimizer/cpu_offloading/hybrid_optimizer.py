# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""An optimizer that steps part of its parameters on the host and the rest in place.

The offloaded share of the parameters is stepped on host copies by ``cpu_optimizer_cls``, one
sub-optimizer per bucket of parameters, so each can start as soon as its gradients have
arrived; the rest is stepped where it lives by ``gpu_optimizer_cls``. Offloaded gradients land
in a small ring of host staging slots, one bucket per slot at a time, and each stepped host
copy is uploaded as it is (an fp32 master is narrowed on the device). A bucket of several small
parameters moves as one block each way: its host copies are views into one flat block, its
gradients are gathered (and widened) into a device staging buffer laid out like its slot, so
each direction costs one copy and one multi-tensor kernel, whatever the number of tensors;
where the host optimizer is torch's fused Adam or AdamW, the bucket is also stepped in one
kernel call over its blocks (:mod:`hybrid_optimizer_flat_step`).
Pinned host memory stays within what megatron-core 0.19.2 keeps pinned for the same
parameters; host copies that do not fit stay pageable and go up through their bucket's slot,
which the next download into it waits for (the plan, made before anything is allocated:
:mod:`hybrid_optimizer_plan`; the buckets and their layouts: :mod:`hybrid_optimizer_buckets`).

Every parameter ``p`` of the public ``param_groups`` has an *inner* tensor that really holds
its optimizer state: a host copy (offloaded), an fp32 clone (``param_update_in_fp32`` with a
16-bit ``p``), or ``p`` itself. ``param_to_inner_param`` is that map; step, save and load all
go through it, so loaded state is cast once, on the device and in the dtype of the inner
tensor, and the sub-optimizers, host copies and gradient buffers live as long as the
optimizer does. ``state[p]`` is the very dict the sub-optimizer steps for the inner tensor
(see :mod:`hybrid_optimizer_state`), so clients that move or reassign state move the real
thing.
"""

import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple, Type

import torch

from megatron.core.optimizer import fork_info
from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.cpu_offloading.host_step_threads import (
    host_step_threads,
    threads_for_host_step,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_buckets import (
    HostBucket,
    share_parted_steps,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_in_place import (
    InPlaceStepMixin,
    fp32_clones,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import tensor_nbytes
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_parts import (
    PART_ALIGN_BYTES,
    copy_part_bytes,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_pending import StepBehindForwardMixin

# The planning helpers are re-exported here, where tests and tools look for them.
# pylint: disable-next=unused-import
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_plan import (
    HostPlan,
    bucket_optimizers,
    pinned_block_bytes,
    plan_host,
    plan_pinned_host_memory,
    sized_bucket_bytes,
    slot_sizes,
    staged_offset,
    upstream_pinned_bytes,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_ring import Ring, RingPlan
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_state import (
    ParamState,
    StateChanges,
    StateMap,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_sync import (
    HDO_OPTIONS,
    SharedStateMixin,
    hyperparameters,
)

# Lets tests and tools tell this implementation from upstream's.
FORK_IMPLEMENTATION = True

# Most bytes of host copies (as staged, alignment included) a host sub-optimizer steps
# together: 16M fp32 elements, a few ms of fused host AdamW, so small parameters share a call
# and the calling thread's work per bucket (queueing its copies: ~0.1-0.2 ms each way) stays
# small beside it, while the pipeline's ends (the first download, the last upload) stay short.
# On an H200 host 64 MiB stepped gpt, moe and stress at 0.5 faster than 16 or 32 MiB, and gpt
# at 1.0 faster than 16 or 4 MiB (see docs/benchmarks.md). A power of two, since the host
# allocator pins blocks of powers of two: a full bucket's block and slot waste nothing, where a
# bucket just past the cap would hold twice its bytes.
_HOST_BUCKET_BYTES = 64 << 20

# The smallest cap size_host_buckets gives (see sized_bucket_bytes).
_LEAST_SIZED_BUCKET_BYTES = 16 << 20

# Gradient staging slots in the host ring: the downloads of the next buckets run while the
# host steps the current one; a third absorbs jitter in either, unless two slots let more host
# copies be pinned within the budget (see plan_pinned_host_memory).
_RING_SLOTS = 3

# Slots asked for when every bucket needs its own (the plan gives one per staged bucket).
_EVERY_BUCKET = 1 << 30

# What _ensure_built creates from the param groups of the moment.
_BUILT_ON_FIRST_USE = frozenset(
    {
        "_host_only",
        "gpu_params_map_cpu_copy",
        "cpu_copys_map_gpu_param",
        "param_to_fp32_param",
        "param_to_inner_param",
        "inner_param_to_orig_param",
        "fp32_param_to_orig_param",
        "_clones_in_place",
        "_clone_block",
        "_stepped_as_is",
        "cpu_param_groups",
        "gpu_param_groups",
        "_host_plan",
        "cpu_optimizers",
        "gpu_optimizer",
        "_flat_in_place",
        "_sub_groups",
        "_owner",
        "cpu_copy_map_grad",
        "_buckets",
        "_ring",
        "_entries",
        "_entries_by_inner",
        "_buckets_of_param",
        "_upload_events",
    }
)


class HybridDeviceOptimizer(
    StepBehindForwardMixin, SharedStateMixin, InPlaceStepMixin, torch.optim.Optimizer
):
    """Adam-style optimizer that splits its parameters between host and accelerator.

    Args:
        params: parameters or param groups, as for any ``torch.optim.Optimizer``.
        offload_fraction: share (by element count) of the accelerator parameters stepped on
            the host. On a host without an accelerator the share is taken from all parameters,
            which get plain host copies, so the same bookkeeping runs everywhere.
        cpu_optimizer_cls: optimizer class for the host copies.
        gpu_optimizer_cls: optimizer class for the parameters stepped in place.
        param_update_in_fp32: step 16-bit parameters on fp32 copies and keep the copy as
            the ``master_param`` state entry.
        pin_cpu_grads: pin the ring of host gradient slots (only where an accelerator exists).
        pin_cpu_params: pin the host parameter copies on the first step (only where an
            accelerator exists, and only as far as upstream's pinned total allows).
        overlap_cpu_optimizer_d2h_h2d: download the gradients of the next host buckets while
            the host steps the current one; without it each download waits for the previous
            bucket's step (one staging slot).
        **kwargs: hyperparameters handed to the sub-optimizers (lr, betas, eps, ...).
    """

    # Step each packed host bucket of torch's fused Adam/AdamW in one kernel call over its
    # blocks (see hybrid_optimizer_flat_step); False steps copy by copy, as a reference.
    flat_host_steps = True

    # Step Transformer Engine's FusedAdam in place over runs of adjacent fp32 clones instead of
    # tensor by tensor, and torch's fused Adam or AdamW by its kernel over the clones' lists
    # without its walk over them (see hybrid_optimizer_flat_in_place); False leaves the step to
    # the in-place sub-optimizer.
    flat_in_place_steps = True

    # Host copies larger than this many bytes (a multiple of PART_ALIGN_BYTES) are stepped and
    # moved in parts of this size, each a bucket of the pipeline, where their sub-optimizer is
    # torch's fused Adam or AdamW (see hybrid_optimizer_parts); 0 moves every copy whole. A
    # bucket's size by default: only copies larger than a bucket (embeddings, output layers)
    # move in parts, so no copy holds up the pipeline or takes a ring slot of its own size.
    host_part_bytes = _HOST_BUCKET_BYTES

    # Cap the host buckets at an eighth of the offloaded bytes (a power of two, between 16 MiB
    # and _HOST_BUCKET_BYTES; see sized_bucket_bytes) instead of the fixed _HOST_BUCKET_BYTES,
    # unless the fixed cap leaves fewer bytes of host copies pageable (_plan_host),
    # and move the copies larger than the cap in parts of it (or of host_part_bytes if
    # smaller). It changes nothing from 512 MiB offloaded up; below that (a data-parallel
    # rank's shards) the pipeline's ends shorten and a smaller ring leaves more copies pinned
    # (docs/benchmarks.md: the step at --dp 8).
    size_host_buckets = True

    # Intra-op threads of the host part of step(): None shares this process's cores among the
    # ranks on the host (LOCAL_WORLD_SIZE) unless MEGATRON_HDO_HOST_STEP_THREADS says otherwise,
    # a number sets it, 0 leaves the caller's count (see host_step_threads).
    host_step_threads = None

    # Run the host part of step() behind the next forward pass: step() queues the downloads
    # and the in-place step, hands the host buckets to a worker thread and returns; the
    # buckets go up in ``host_step_order`` and ``wait_for_params`` waits for some parameters'
    # buckets alone, while everything that reads the optimizer (``state``, its state dicts, the
    # next step) waits for the whole step (see hybrid_optimizer_pending). Read when the
    # placement is built (the first step or load): every bucket then gets a ring slot of its
    # own, so that every download is queued before step() returns. The distributed optimizer
    # sets it from ``overlap_cpu_optimizer_step_with_forward`` in its config.
    overlap_cpu_optimizer_step_with_forward = False

    # With the option above: a key giving each public parameter's place in the next forward
    # (smaller first); host buckets are stepped in the order of their first parameter's key.
    # None keeps the parameters' order.
    host_step_order = None

    def __init__(
        self,
        params: Iterable[Any],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Optional[Type[torch.optim.Optimizer]] = None,
        gpu_optimizer_cls: Optional[Type[torch.optim.Optimizer]] = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        **kwargs: Any,
    ):
        fork_info.announce(type(self))
        options = dict(
            offload_fraction=offload_fraction,
            cpu_optimizer_cls=cpu_optimizer_cls,
            gpu_optimizer_cls=gpu_optimizer_cls,
            param_update_in_fp32=param_update_in_fp32,
            pin_cpu_grads=pin_cpu_grads,
            pin_cpu_params=pin_cpu_params,
            overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
        )
        # Param groups only carry what the sub-optimizers read; the options are also
        # attributes of the same names, as Megatron code reads them.
        super().__init__(params, dict(kwargs))
        vars(self).update(options)
        self.defaults = {**options, **kwargs}
        self.sub_optimizer_kwargs = kwargs

        # Placement and sub-optimizers are built on first use (see __getattr__), so a wrapper
        # that regroups the parameters first never allocates for the groups it replaces.
        self._d2h_stream, self._h2d_stream = self._make_streams()
        # D2H event of each host sub-optimizer whose gradients are on their way (in a step).
        self._cpu_optimizer_map_data_event: Dict[torch.optim.Optimizer, Any] = {}
        self._state_changes = StateChanges()
        # Each public group's step as last handed to or taken from the sub-groups.
        self._group_steps_in_sync: List[Any] = []
        self.state = StateMap(self._entry_of)
        self._load_guard = checks.LoadGuard(type(self).__name__)
        self._register_load_state_dict_hooks()

    # ------------------------------------------------------------------ placement

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes not set yet: those of the placement are built here.
        if name in _BUILT_ON_FIRST_USE and not vars(self).get("_building", False):
            self._ensure_built()
            return getattr(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _ensure_built(self):
        """Place the parameters and build the sub-optimizers for the current groups, once."""
        if "param_to_inner_param" in vars(self):
            return
        part_bytes = self.host_part_bytes
        if part_bytes < 0 or part_bytes % PART_ALIGN_BYTES:
            raise ValueError(
                f"host_part_bytes={part_bytes} must be 0 or a multiple of "
                f"{PART_ALIGN_BYTES} bytes"
            )
        self._building = True
        try:
            self._place_params()
            self._build_sub_optimizers()
        finally:
            self._building = False

    def _init_sub_optimizers(self):
        """Build the placement and the sub-optimizers if they are not built yet.

        They are built once per optimizer: host copies, gradient slots and sub-optimizers live
        as long as it does, and the sub-optimizers' state is the state ``self.state`` shows, so
        there is nothing to rebuild after a load (follow with
        ``_sync_hdo_state_to_sub_optimizers`` after writing ``self.state`` wholesale).
        """
        self._ensure_built()

    def _get_sub_optimizer_param_groups(self, offload_fraction: float):
        """The host and in-place groups and the copy maps of the placement.

        Args:
            offload_fraction: must be the optimizer's own; the placement is made once.

        Returns:
            ``(cpu_param_groups, gpu_param_groups, gpu_params_map_cpu_copy,
            cpu_copys_map_gpu_param, param_to_fp32_param)``.

        Raises:
            ValueError: for another fraction than the one the optimizer was placed with.
        """
        if offload_fraction != self.offload_fraction:
            raise ValueError(
                f"HybridDeviceOptimizer is placed once, with offload_fraction="
                f"{self.offload_fraction}; build another optimizer for {offload_fraction}"
            )
        return (
            self.cpu_param_groups,
            self.gpu_param_groups,
            self.gpu_params_map_cpu_copy,
            self.cpu_copys_map_gpu_param,
            self.param_to_fp32_param,
        )

    def replace_param_groups(self, param_groups: Iterable[Dict[str, Any]]):
        """Regroup the parameters before any state exists, without building anything twice.

        The distributed optimizer hands over the groups of the shards its rank owns; host
        copies, gradient buffers and sub-optimizers are then built for those alone, when
        first needed. Whatever was built for the previous groups is dropped.

        Args:
            param_groups: dicts with ``"params"`` and the group's hyperparameters.

        Raises:
            RuntimeError: if the optimizer already holds state.
        """
        if any(self.state.values()):
            raise RuntimeError(
                "HybridDeviceOptimizer.replace_param_groups: the optimizer already holds "
                "state; regroup it before its first step or load"
            )
        for name in _BUILT_ON_FIRST_USE.intersection(vars(self)):
            delattr(self, name)
        self.state.clear()
        self.param_groups = []
        self._group_steps_in_sync = []
        # torch fills a new group's missing keys from ``defaults``; the groups carry only the
        # sub-optimizers' hyperparameters, never the HDO's own options.
        defaults, self.defaults = self.defaults, dict(self.sub_optimizer_kwargs)
        try:
            for group in param_groups:
                self.add_param_group({k: v for k, v in group.items() if k not in HDO_OPTIONS})
        finally:
            self.defaults = defaults

    def _place_params(self):
        """Choose each parameter's inner tensor; fills the maps step, save and load share."""
        params = [p for group in self.param_groups for p in group["params"]]
        on_device = [p for p in params if p.device.type != "cpu"]
        # Without accelerator parameters the host plays the device's part, so the offloaded
        # share still runs on separate copies (CPU-only hosts test the real path).
        self._host_only = not on_device
        if self._host_only:
            # Nothing to copy across devices: no stream to order copies on, even where CUDA
            # exists (a CPU-only model in a CUDA process).
            self._d2h_stream = self._h2d_stream = None
        candidates = params if self._host_only else on_device
        budget = self.offload_fraction * sum(p.numel() for p in candidates)
        candidate_ids = {id(p) for p in candidates}

        self.gpu_params_map_cpu_copy: Dict[torch.Tensor, torch.Tensor] = {}
        self.cpu_copys_map_gpu_param: Dict[torch.Tensor, torch.Tensor] = {}
        self.param_to_fp32_param: Dict[torch.Tensor, torch.Tensor] = {}
        self.param_to_inner_param: Dict[torch.Tensor, torch.Tensor] = {}
        self.inner_param_to_orig_param: Dict[torch.Tensor, torch.Tensor] = {}
        offloaded, placement = 0, []
        for param in params:
            widen = self.param_update_in_fp32 and param.dtype != torch.float32
            on_host = id(param) in candidate_ids and offloaded < budget
            if on_host:
                offloaded += param.numel()
            placement.append((param, widen, on_host))
        clones, self._clone_block = fp32_clones(
            [p for p, widen, on_host in placement if widen and not on_host]
        )
        clones = iter(clones)
        for param, widen, on_host in placement:
            if on_host:
                # Pageable for now: the first step pins the copies it uploads from (see
                # _plan_grad_ring), so a build that a checkpoint load triggers pins nothing.
                inner = torch.empty(
                    param.shape, dtype=torch.float32 if widen else param.dtype, device="cpu"
                )
                inner.copy_(param.detach())
                self.gpu_params_map_cpu_copy[param] = inner
                self.cpu_copys_map_gpu_param[inner] = param
            elif widen:
                inner = next(clones)
            else:
                inner = param
            if widen:
                self.param_to_fp32_param[param] = inner
            self.param_to_inner_param[param] = inner
            self.inner_param_to_orig_param[inner] = param
        self.fp32_param_to_orig_param = {v: k for k, v in self.param_to_fp32_param.items()}
        # fp32 clones stepped where their parameter lives (not on a host copy).
        self._clones_in_place = [
            (param, clone)
            for param, clone in self.param_to_fp32_param.items()
            if param not in self.gpu_params_map_cpu_copy
        ]
        # Parameters the in-place optimizer steps as they are (no copy, no clone).
        self._stepped_as_is = [p for p, inner in self.param_to_inner_param.items() if inner is p]

    def _steps_on_host(self, inner: torch.Tensor) -> bool:
        """Whether ``inner`` is stepped by a host sub-optimizer."""
        if inner in self.cpu_copys_map_gpu_param:
            return True
        return not self._host_only and inner.device.type == "cpu"

    def _build_sub_optimizers(self):
        self.cpu_param_groups: List[Dict[str, Any]] = []
        self.gpu_param_groups: List[Dict[str, Any]] = []
        for group in self.param_groups:
            host = [self.param_to_inner_param[p] for p in group["params"]]
            device = [t for t in host if not self._steps_on_host(t)]
            host = [t for t in host if self._steps_on_host(t)]
            for params, target in ((host, self.cpu_param_groups), (device, self.gpu_param_groups)):
                if params:
                    target.append({**hyperparameters(group), "params": params})

        # Buckets in both modes: they bound the gradient staging (and so the pinned memory);
        # the overlap option decides how many buckets are in flight (see _plan_grad_ring).
        self._host_plan = self._plan_host()
        self.cpu_optimizers = self._host_plan.optimizers
        self.gpu_optimizer = (
            self.gpu_optimizer_cls(self.gpu_param_groups) if self.gpu_param_groups else None
        )
        self._flat_in_place = None

        # Which public group each sub-optimizer group follows, and which sub-optimizer
        # steps each inner tensor.
        group_of_inner = {
            self.param_to_inner_param[p]: index
            for index, group in enumerate(self.param_groups)
            for p in group["params"]
        }
        self._sub_groups: List[Tuple[Dict[str, Any], int]] = []
        self._owner: Dict[torch.Tensor, torch.optim.Optimizer] = {}
        for optimizer in self.sub_optimizers:
            for sub_group in optimizer.param_groups:
                self._sub_groups.append((sub_group, group_of_inner[sub_group["params"][0]]))
                for inner in sub_group["params"]:
                    self._owner[inner] = optimizer
        # One state dict per parameter, which the sub-optimizer steps and ``state`` shows. The
        # sub-optimizers' ``state`` maps refill the same dicts when a whole dict is assigned.
        self._entries: Dict[torch.Tensor, ParamState] = {}
        self._entries_by_inner: Dict[torch.Tensor, ParamState] = {}
        for optimizer in self.sub_optimizers:
            optimizer.state = self._new_sub_state_map()
        for param, inner in self.param_to_inner_param.items():
            owner = self._owner[inner]
            entry = ParamState(param, inner, owner, self.param_update_in_fp32, self._state_changes)
            self._entries[param] = self._entries_by_inner[inner] = entry
            dict.__setitem__(owner.state, inner, entry)
        self._plan_grad_ring()

    def _host_bucket_bytes(self) -> int:
        """The sized cap on a host bucket's staged bytes (``size_host_buckets``)."""
        if not self.size_host_buckets:
            return _HOST_BUCKET_BYTES
        offloaded = self.cpu_copys_map_gpu_param
        staged = sum(
            tensor_nbytes(host)
            for group in self.cpu_param_groups
            for host in group["params"]
            if host in offloaded
        )
        return sized_bucket_bytes(staged, _HOST_BUCKET_BYTES, least=_LEAST_SIZED_BUCKET_BYTES)

    def _plan_host(self) -> HostPlan:
        """The host sub-optimizers, one a bucket, their buckets and what the ring and pins
        would be, for the fixed cap or (``size_host_buckets``) for whichever of the sized and
        the fixed cap leaves fewer bytes of host copies pageable within upstream's pinned
        budget, the smaller on a tie: a pageable copy costs each step a host copy into its slot
        before its upload, and smaller buckets, whose power-of-two blocks are filled less, can
        leave out a copy that the fixed cap pins. Nothing is allocated."""
        caps = sorted({self._host_bucket_bytes(), _HOST_BUCKET_BYTES})

        def plan(behind: bool) -> HostPlan:
            slots = _RING_SLOTS if self.overlap_cpu_optimizer_d2h_h2d else 1
            return plan_host(
                lambda cap: self._in_step_order(
                    self.build_cpu_optimizer_list(
                        self.cpu_optimizer_cls, self.cpu_param_groups, cap
                    )
                ),
                [(cap, self._part_bytes(cap)) for cap in caps],
                self.cpu_copys_map_gpu_param,
                _EVERY_BUCKET if behind else slots,
                self.pin_cpu_grads,
                self.pin_cpu_params,
                keep_slots=behind,
            )

        if not self.overlap_cpu_optimizer_step_with_forward:
            return plan(False)
        chosen = plan(True)
        if chosen.pin_slots and chosen.ring_held_bytes > chosen.budget:
            warnings.warn(
                "overlap_cpu_optimizer_step_with_forward is off: a pinned slot for every host "
                f"bucket would hold {chosen.ring_held_bytes} bytes, more than megatron-core "
                f"0.19.2 pins for these parameters ({chosen.budget}); the step runs as before",
                stacklevel=2,
            )
            return plan(False)
        return chosen

    def _plan_grad_ring(self):
        """Take the host plan's buckets and make the ring; allocate nothing yet.

        Buckets are stepped in the sub-optimizers' order (a copy in parts as its run of parts).
        The k-th bucket with offloaded parameters packs its gradients into ring slot
        ``k % slots``, and the download of bucket ``k + slots`` starts once bucket ``k`` has
        been stepped; a slot holds the largest of its buckets. With overlap the ring has up to
        ``_RING_SLOTS`` slots, so downloads run ahead of the host steps; without it one, so
        each download waits for the previous bucket's step. What is pinned (the slots, then
        each host copy in upload order that still fits) stays within what upstream keeps pinned
        for the same parameters, both counted in the power-of-two blocks the host allocator
        holds (see :func:`plan_pinned_host_memory`); a packed bucket's block is pinned or not
        as a whole. The copies left pageable go up through their bucket's slot (see
        :meth:`HostBucket.stage_upload`).
        """
        plan = self._host_plan
        self.cpu_copy_map_grad: Dict[torch.Tensor, torch.Tensor] = {}
        self._buckets: List[HostBucket] = plan.buckets
        share_parted_steps(self._buckets, self._entries_by_inner.__getitem__)
        staged, slots = plan.staged, plan.slots
        for k, index in enumerate(staged):
            self._buckets[index].slot = k % slots
            if k + slots < len(staged):
                self._buckets[index].follower = staged[k + slots]
        chosen = [unit for (unit, _), pin in zip(plan.units, plan.pinned) if pin]
        ring_plan = RingPlan(
            slots,
            plan.ring_bytes,
            plan.pin_slots,
            staged[:slots],
            [unit for unit in chosen if isinstance(unit, torch.Tensor)],
            [unit for unit in chosen if not isinstance(unit, torch.Tensor)],
            plan.packed_slots,
        )
        self._ring = Ring(
            self._d2h_stream, self._h2d_stream, self._cpu_optimizer_map_data_event, ring_plan
        )

    def _part_bytes(self, cap: int) -> int:
        """The size of the parts a large host copy moves in (0: whole) with buckets of at most
        ``cap`` bytes: ``host_part_bytes``, or with ``size_host_buckets`` the cap where that is
        smaller."""
        return copy_part_bytes(self.host_part_bytes, cap if self.size_host_buckets else None)

    @torch.no_grad()
    def _allocate_ring(self):
        """On the first step: allocate the slots, view each gradient into its slot, pin copies,
        gather each packed bucket's copies into one block, make the device staging buffers."""
        ring = self._ring
        if not ring.allocate_slots():
            return
        for bucket in self._buckets:
            bucket.take_slot(ring, self.cpu_copy_map_grad)
        entry_of, flat_steps = self._entries_by_inner.__getitem__, self.flat_host_steps
        pinned_blocks = set(ring.plan.blocks_to_pin)
        for index, bucket in enumerate(self._buckets):
            bucket.pack(ring, index in pinned_blocks, flat_steps, entry_of)
        for host in ring.plan.masters_to_pin:
            # Swapping ``.data`` keeps the tensor object the sub-optimizer and maps key on.
            host.data = host.pin_memory()
        for bucket in self._buckets:  # the copies are where they stay
            bucket.settle_layout(ring, flat_steps, entry_of)
        on_device = [bucket for bucket in self._buckets if bucket.stages_on_device()]
        if on_device:
            nbytes = max(bucket.nbytes for bucket in on_device)
            ring.allocate_device_staging(nbytes, on_device[0].params[0].device)
            for bucket in on_device:
                bucket.take_device_staging(ring)

    @staticmethod
    def build_cpu_optimizer_list(cpu_optimizer_cls, cpu_param_groups, bucket_bytes: int = 0):
        """Build the host optimizers, each over a run of parameters that fits ``bucket_bytes``
        as staged, so that their steps overlap the copies (see
        :func:`~hybrid_optimizer_plan.bucket_optimizers`; 0: one per parameter, as upstream).

        Args:
            cpu_optimizer_cls (Type[torch.optim.Optimizer]): the host optimizer class.
            cpu_param_groups (List[Dict[str, Any]]): host param groups with hyperparameters.
            bucket_bytes (int): most staged bytes one optimizer steps.

        Returns:
            List[torch.optim.Optimizer]: the optimizers, in group and parameter order.
        """
        return bucket_optimizers(cpu_optimizer_cls, cpu_param_groups, bucket_bytes)

    @staticmethod
    def _make_streams():
        """Side streams for the copies where CUDA exists; none on a host-only run."""
        if not torch.cuda.is_available():
            return None, None
        return torch.cuda.Stream(), torch.cuda.Stream()

    @property
    def sub_optimizers(self):
        """The host sub-optimizers followed by the in-place one, if any."""
        if self.gpu_optimizer is None:
            return list(self.cpu_optimizers)
        return self.cpu_optimizers + [self.gpu_optimizer]

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """Step every sub-optimizer and write the results back into the parameters.

        Args:
            closure (Callable, optional): re-evaluates the model and returns the loss.
        """
        self.finish_step()  # a step still running behind the forward comes first
        self._load_guard.check("step")
        # Read before anything changes, so that a bad override fails the step cleanly.
        threads = host_step_threads(self.host_step_threads)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_built()
        self._sync_hdo_param_groups_to_sub_optimizers()
        self._settle_state_written_outside()
        self._allocate_ring()
        lent = self._lend_decoupled_grads()
        steps_before = [sub_group.get("step") for sub_group, _ in self._sub_groups]
        if self._steps_behind_forward():
            self._start_behind_forward(threads, lent, steps_before)
            return loss

        # D2H -> host step -> H2D, one bucket after the other. A bucket's slot is free again
        # once its host step has returned and its upload is queued, so that is when the
        # download of the bucket that reuses the slot is queued (behind the upload, on the D2H
        # stream, where a pageable copy goes up through the slot).
        ring = self._ring
        try:
            with threads_for_host_step(threads):
                self._start_step()
                for bucket in self._buckets:
                    self._after_host_step(bucket, bucket.step(ring))
        finally:
            for param in lent:
                param.grad = None
            ring.end_step()
        self._mirror_group_steps(steps_before)
        self._list_created_state()
        return loss

    def _start_step(self):
        """Begin the ring's step: queue the first downloads, and step in place while they
        run, on the calling thread (on a worker its Python and the host steps' would wait for
        each other's GIL: see docs/benchmarks.md)."""
        ring = self._ring
        ring.begin_step()
        for index in ring.plan.first_downloads:
            self._download(index)
        self._step_in_place_whole()

    def _register_param_copy_back_gpu_hook(self):
        """Nothing to register: ``step`` uploads each host bucket itself, as soon as it is
        stepped, and copies the fp32 clones back after the in-place step."""

    def _after_host_step(self, bucket: HostBucket, ready: List[HostBucket]) -> None:
        """Queue the uploads of the buckets just stepped (``ready``) and the download that
        reuses the bucket's slot, after the bucket's own upload, which its pageable copies
        make through the slot; the other parts of a gathered copy go up from their memory."""
        ring = self._ring
        if any(stepped is bucket for stepped in ready):
            bucket.queue_upload(ring, *bucket.stage_upload(ring, staged_in_slot=True))
        if bucket.follower is not None:
            self._download(bucket.follower)
        for stepped in ready:
            if stepped is not bucket:
                stepped.queue_upload(ring, *stepped.stage_upload(ring, staged_in_slot=False))

    def _download(self, index: int):
        """Queue the D2H of bucket ``index``'s gradients into its slot and note its event in
        ``_cpu_optimizer_map_data_event`` (where CUDA exists); see
        :meth:`HostBucket.download`."""
        self._buckets[index].download(self._ring)

    # ------------------------------------------------------------------ misc API

    def zero_grad(self, set_to_none: bool = True):
        """Clear the gradients of the public parameters, ``decoupled_grad`` included."""
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for param in group["params"]:
                if getattr(param, "decoupled_grad", None) is None:
                    continue
                if set_to_none:
                    param.decoupled_grad = None
                else:
                    param.decoupled_grad.zero_()
