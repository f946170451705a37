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
:mod:`hybrid_optimizer_plan`; the layouts: :mod:`hybrid_optimizer_copies`).

Every parameter ``p`` of the public ``param_groups`` has an *inner* tensor that really holds
its optimizer state: a host copy (offloaded), an fp32 clone (``param_update_in_fp32`` with a
16-bit ``p``), or ``p`` itself. ``param_to_inner_param`` is that map; step, save and load all
go through it, so loaded state is cast once, on the device and in the dtype of the inner
tensor, and the sub-optimizers, host copies and gradient buffers live as long as the
optimizer does. ``state[p]`` is the very dict the sub-optimizer steps for the inner tensor
(see :mod:`hybrid_optimizer_state`), so clients that move or reassign state move the real
thing.
"""

from typing import Any, Dict, Iterable, List, Optional, Tuple, Type

import torch

from megatron.core.optimizer import fork_info
from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_buckets import (
    HostBucket,
    share_parted_steps,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_in_place import (
    fp32_clones,
    in_place_step,
    widened,
    widened_block,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import (
    MOMENT_NAMES,
    FusedStep,
    grad_of,
    tensor_nbytes,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_parts import (
    PART_ALIGN_BYTES,
    copy_part_bytes,
)

# The planning helpers are re-exported here, where tests and tools look for them.
# pylint: disable-next=unused-import
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_plan import (
    HostPlan,
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
    MASTER,
    ParamState,
    StateChanges,
    StateMap,
    home_of,
    placed,
    plan_step_counts,
)
from megatron.core.optimizer.inner_optimizer_state import materialise_by_null_step, step_counter_of

# Lets tests and tools tell this implementation from upstream's.
FORK_IMPLEMENTATION = True

# Constructor options of the hybrid optimizer itself. They live in ``defaults`` (so that
# ``HybridDeviceOptimizer(params, **opt.defaults)`` rebuilds an equivalent optimizer) but
# never in param groups, which would put classes into checkpoints.
_HDO_OPTIONS = (
    "offload_fraction",
    "cpu_optimizer_cls",
    "gpu_optimizer_cls",
    "param_update_in_fp32",
    "pin_cpu_grads",
    "pin_cpu_params",
    "overlap_cpu_optimizer_d2h_h2d",
)

# Most bytes of host copies (as staged, alignment included) a host sub-optimizer steps
# together: 16M fp32 elements, a few ms of fused host AdamW, so small parameters share a call
# and the calling thread's work per bucket (queueing its copies: ~0.1-0.2 ms each way) stays
# small beside it, while the pipeline's ends (the first download, the last upload) stay short.
# On an H200 host 64 MiB stepped gpt, moe and stress at 0.5 faster than 16 or 32 MiB, and gpt
# at 1.0 faster than 16 or 4 MiB (see docs/measurements.md). A power of two, since the host
# allocator pins blocks of powers of two: a full bucket's block and slot waste nothing, where a
# bucket just past the cap would hold twice its bytes.
_HOST_BUCKET_BYTES = 64 << 20

# The smallest cap size_host_buckets gives (see sized_bucket_bytes).
_LEAST_SIZED_BUCKET_BYTES = 16 << 20

# Gradient staging slots in the host ring: the downloads of the next buckets run while the
# host steps the current one; a third absorbs jitter in either, unless two slots let more host
# copies be pinned within the budget (see plan_pinned_host_memory).
_RING_SLOTS = 3

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
    }
)


def _hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
    """The entries of a param group that a sub-optimizer should follow."""
    return {k: v for k, v in group.items() if k not in ("params", "step") + _HDO_OPTIONS}


class HybridDeviceOptimizer(torch.optim.Optimizer):
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
    # (docs/measurements.md: the step at --dp 8).
    size_host_buckets = True

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

    def _new_sub_state_map(self) -> StateMap:
        """A sub-optimizer's ``state``: its inner tensors map to the shared entries."""
        return StateMap(self._entries_by_inner.get)

    def _shared_sub_state(self, optimizer: torch.optim.Optimizer) -> StateMap:
        """``optimizer.state``, put back to a shared map if it was replaced as a whole."""
        if not isinstance(optimizer.state, StateMap):
            optimizer.state = self._new_sub_state_map()
        return optimizer.state

    def _entry_of(self, param) -> Optional[ParamState]:
        """The state dict shared by ``param`` and its sub-optimizer (None for other keys)."""
        if not isinstance(param, torch.Tensor):
            return None
        return self._entries.get(param)

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
        # torch fills a new group's missing keys from ``defaults``; the groups carry only the
        # sub-optimizers' hyperparameters, never the HDO's own options.
        defaults, self.defaults = self.defaults, dict(self.sub_optimizer_kwargs)
        try:
            for group in param_groups:
                self.add_param_group({k: v for k, v in group.items() if k not in _HDO_OPTIONS})
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
                    target.append({**_hyperparameters(group), "params": params})

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
        return plan_host(
            lambda cap: self.build_cpu_optimizer_list(
                self.cpu_optimizer_cls, self.cpu_param_groups, cap
            ),
            [(cap, self._part_bytes(cap)) for cap in caps],
            self.cpu_copys_map_gpu_param,
            _RING_SLOTS if self.overlap_cpu_optimizer_d2h_h2d else 1,
            self.pin_cpu_grads,
            self.pin_cpu_params,
        )

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
        """Build the host optimizers that overlap their steps with the copies.

        Each optimizer steps a run of consecutive parameters of one group that, laid out as
        their gradients are staged (each at a ``GRAD_ALIGN`` boundary), fit in
        ``bucket_bytes``, so it can start as soon as its gradients have landed while small
        parameters share one call. Parameters already on the host are counted too, though
        they stage nothing, so a bucket's staged bytes never exceed the cap. A parameter
        larger than that has an optimizer of its own. With the default 0 every parameter has
        its own, as upstream builds them.

        Args:
            cpu_optimizer_cls (Type[torch.optim.Optimizer]): the host optimizer class.
            cpu_param_groups (List[Dict[str, Any]]): host param groups with hyperparameters.
            bucket_bytes (int): most staged bytes one optimizer steps.

        Returns:
            List[torch.optim.Optimizer]: the optimizers, in group and parameter order.
        """
        optimizers = []
        for group in cpu_param_groups:
            params = group["params"]
            if isinstance(params, torch.Tensor):
                params = [params]
            settings = {k: v for k, v in group.items() if k != "params"}
            bucket, end = [], 0
            for param in params:
                offset = staged_offset(end)
                if bucket and (bucket_bytes <= 0 or offset + tensor_nbytes(param) > bucket_bytes):
                    optimizers.append(cpu_optimizer_cls([{**settings, "params": bucket}]))
                    bucket, offset = [], 0
                bucket.append(param)
                end = offset + tensor_nbytes(param)
            if bucket:
                optimizers.append(cpu_optimizer_cls([{**settings, "params": bucket}]))
        return optimizers

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
        self._load_guard.check("step")
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

        # D2H -> host step -> H2D, one bucket after the other. A bucket's slot is free again
        # once its host step has returned and its upload is queued, so that is when the
        # download of the bucket that reuses the slot is queued (behind the upload, on the D2H
        # stream, where a pageable copy goes up through the slot).
        ring = self._ring
        try:
            ring.begin_step()
            for index in ring.plan.first_downloads:
                self._download(index)
            # While the first downloads run; on the calling thread, since on a worker its Python
            # and the host steps' would wait for each other's GIL (see docs/measurements.md).
            self._step_in_place_whole()
            for bucket in self._buckets:
                self._after_host_step(bucket, bucket.step(ring))
        finally:
            for param in lent:
                param.grad = None
            ring.end_step()
        self._mirror_group_steps(steps_before)
        self._list_created_state()
        return loss

    def _flat_in_place_step(self) -> Optional[FusedStep]:
        """The step that spares the in-place sub-optimizer of the moment its walk over the
        parameters (see :func:`in_place_step`), if it is on."""
        optimizer = self.gpu_optimizer
        if optimizer is None or not self.flat_in_place_steps:
            return None
        if self._flat_in_place is None or self._flat_in_place.optimizer is not optimizer:
            self._flat_in_place = in_place_step(optimizer)
        return self._flat_in_place

    def _step_in_place(self):
        """The in-place sub-optimizer's step, if there is one: over runs of adjacent tensors
        where it is TE's FusedAdam and its state is laid out for that, else its own."""
        flat = self._flat_in_place_step()
        if flat is not None and flat.step():
            return
        if self.gpu_optimizer is not None:
            self.gpu_optimizer.step()
            if flat is not None:
                flat.lay_out()  # so that the next step can take runs

    def _step_clones_from_buffer(self) -> bool:
        """The in-place step where the in-place sub-optimizer steps the fp32 clones alone and
        is TE's FusedAdam (over runs of them) or torch's fused Adam or AdamW (its kernel over
        their lists): their gradients are widened into one buffer laid out like the clones'
        block and handed over from there, with no gradient set on any clone. False (nothing
        stepped) where that does not apply this step."""
        flat, block = self._flat_in_place_step(), self._clone_block
        if flat is None or block is None or not flat.applies():
            return False
        stepped = sum(len(group["params"]) for group in flat.optimizer.param_groups)
        if stepped != len(self._clones_in_place):
            return False
        grads = [grad_of(param) for param, _ in self._clones_in_place]
        if any(grad is None for grad in grads):
            return False
        widened = widened_block(grads)
        if widened is None or widened.numel() != block.numel():
            return False  # a gradient of another size: the offsets would not match
        return flat.step(grads=(widened, block.data_ptr()))

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

    def _set_sub_optimizer_grads(self) -> List[torch.Tensor]:
        """Give the inner tensors stepped in place their gradients for this step.

        fp32 clones get the widened gradient (``_widen_clone_grads``); parameters stepped as
        they are borrow ``decoupled_grad`` (``_lend_decoupled_grads``). The host
        sub-optimizers' gradients are downloaded bucket by bucket during the step, into the
        ring's slots (``_download``).

        Returns:
            The parameters that borrowed a gradient, to be cleared after the step.
        """
        self._widen_clone_grads()
        return self._lend_decoupled_grads()

    def _widen_clone_grads(self):
        """Give each fp32 clone stepped in place its parameter's gradient, widened."""
        if self._clones_in_place:
            clones = [clone for _, clone in self._clones_in_place]
            grads = [grad_of(param) for param, _ in self._clones_in_place]
            for clone, grad in zip(clones, widened(grads)):
                clone.grad = grad

    def _lend_decoupled_grads(self) -> List[torch.Tensor]:
        """Lend ``decoupled_grad`` as ``grad`` to the parameters stepped as they are.

        torch and TE optimizers read ``grad``, while the precision-aware distributed optimizer
        leaves fp32 shards their gradient in ``decoupled_grad`` only.

        Returns:
            The parameters that borrowed a gradient, to be cleared after the step.
        """
        lent = []
        for param in self._stepped_as_is:
            decoupled = getattr(param, "decoupled_grad", None)
            if decoupled is not None and param.grad is None:
                param.grad = decoupled.to(param.dtype)
                lent.append(param)
        return lent

    def _step_in_place_whole(self):
        """All the in-place side of a step: the clones' widened gradients, the in-place
        sub-optimizer's step, and the clones copied back into their parameters."""
        from_buffer = self._step_clones_from_buffer()
        if not from_buffer:
            self._widen_clone_grads()
            self._step_in_place()
        if self._clones_in_place:
            params, clones = (list(t) for t in zip(*self._clones_in_place))
            torch._foreach_copy_(params, clones)  # pylint: disable=protected-access
            if not from_buffer:
                for clone in clones:
                    clone.grad = None  # the widened gradient is only needed for this step

    def _register_param_copy_back_gpu_hook(self):
        """Nothing to register: ``step`` uploads each host bucket itself, as soon as it is
        stepped, and copies the fp32 clones back after the in-place step."""

    def _download(self, index: int):
        """Queue the D2H of bucket ``index``'s gradients into its slot and note its event in
        ``_cpu_optimizer_map_data_event`` (where CUDA exists); see
        :meth:`HostBucket.download`."""
        self._buckets[index].download(self._ring)

    def _mirror_group_steps(self, steps_before: List[Any]):
        """Copy the step of sub-optimizers that count it in their param groups (TE, Apex)."""
        for (sub_group, index), before in zip(self._sub_groups, steps_before):
            step = sub_group.get("step")
            if step is not None and step is not before:
                self.param_groups[index]["step"] = step

    # ------------------------------------------------------------------ state sync

    def _sync_hdo_param_groups_to_sub_optimizers(self):
        """Push the public groups' hyperparameters (lr, weight decay, ...) to the sub-groups."""
        for sub_group, index in self._sub_groups:
            sub_group.update(_hyperparameters(self.param_groups[index]))

    def _hand_back_group_steps(self):
        """Give the public groups' loaded steps to the sub-groups: a group loaded without one
        leaves its sub-groups none, as a sub-optimizer's own load would."""
        for sub_group, index in self._sub_groups:
            if "step" in self.param_groups[index]:
                sub_group["step"] = self.param_groups[index]["step"]
            else:
                sub_group.pop("step", None)

    def _list_created_state(self):
        """Show in ``self.state`` the entries that got state since the last look (the
        sub-optimizers' first step creates it), with their ``master_param``."""
        created = self._state_changes.created
        if not created:
            return
        # In parameter order, whichever sub-optimizer made it first.
        order = {id(entry): index for index, entry in enumerate(self._entries.values())}
        for entry in sorted(created, key=lambda entry: order.get(id(entry), len(order))):
            self._list_entry(entry)
        created.clear()

    def _list_entry(self, entry: ParamState):
        if not entry:
            return
        if entry.keeps_master and MASTER not in entry:
            dict.__setitem__(entry, MASTER, entry.inner)
        if dict.get(self.state, entry.param) is not entry:
            dict.__setitem__(self.state, entry.param, entry)

    def _sync_sub_optimizers_state_to_hdo(self):
        """Show every parameter's state in ``self.state``: its one entry, shared with the
        sub-optimizer, listed once it holds state."""
        if not isinstance(self.state, StateMap):
            self.state = StateMap(self._entry_of)
        for entry in self._entries.values():
            self._list_entry(entry)
        self._state_changes.created.clear()

    def _settle_state_written_outside(self):
        """Before a step: take home the state that clients left elsewhere.

        Entries parked on the host go back to their accelerator; a ``state`` replaced as a
        whole is adopted. Nothing is scanned when neither happened.
        """
        if not isinstance(self.state, StateMap):
            self._sync_hdo_state_to_sub_optimizers()
            return
        for optimizer in self.sub_optimizers:
            if not isinstance(optimizer.state, StateMap):
                self._adopt_sub_optimizer_state(optimizer)
        parked = self._state_changes.parked
        if parked:
            self._lay_out_in_place_state()
        for entry in parked.values():
            entry.settle()
        parked.clear()

    def _adopt_sub_optimizer_state(self, optimizer: torch.optim.Optimizer):
        """Take in a sub-optimizer's ``state`` that was replaced as a whole (its own
        ``load_state_dict``, say): its dicts refill the shared entries, which it gets back."""
        replaced = optimizer.state
        optimizer.state = self._new_sub_state_map()
        for entry in self._entries.values():
            if entry.optimizer is not optimizer:
                continue
            values = replaced.get(entry.inner)
            if values is None:
                dict.clear(entry)
            elif values is not entry:
                entry.refill(values)
            dict.__setitem__(optimizer.state, entry.inner, entry)
            self._list_entry(entry)

    def _sync_hdo_state_to_sub_optimizers(self):
        """Make what ``self.state`` shows the state that is stepped, wherever it was written.

        Assignments into ``self.state[p]`` reach the sub-optimizer by themselves (it is the
        same dict); this adopts what bypassed them: a ``state`` mapping or a per-parameter dict
        replaced as a whole, or a sub-optimizer's entry replaced. Then every ``master_param``
        is written into its inner tensor and every state tensor is moved home.
        """
        shown = self.state
        replaced = not isinstance(shown, StateMap)
        if replaced:
            self.state = StateMap(self._entry_of)
        for param, entry in self._entries.items():
            value = shown.get(param)
            if value is not None and value is not entry:
                entry.refill(value)
            elif replaced and value is None:
                dict.clear(entry)
            sub_state = self._shared_sub_state(entry.optimizer)
            if dict.get(sub_state, entry.inner) is not entry:
                dict.__setitem__(sub_state, entry.inner, entry)
        self._sync_sub_optimizers_state_to_hdo()
        self._update_fp32_params_by_new_state()
        self._move_new_state_to_right_device()

    @torch.no_grad()
    def _update_fp32_params_by_new_state(self):
        """Write each entry's ``master_param`` into the inner tensor it stands for, where
        something other than that tensor was put there, and show the inner tensor again."""
        if not self.param_update_in_fp32:
            return
        for entry in self._entries.values():
            master = dict.get(entry, MASTER)
            if isinstance(master, torch.Tensor) and master is not entry.inner:
                entry.inner.copy_(master.reshape(entry.inner.shape))
                dict.__setitem__(entry, MASTER, entry.inner)

    def _move_new_state_to_right_device(self):
        """Move every state tensor to where its inner tensor keeps it.

        Host copies' state goes to the host, the state of tensors stepped in place to their
        device, decided by where each inner tensor lives; the dtype becomes the one the
        sub-optimizer keeps it in. State already home is left as it is, so nothing is
        allocated on the accelerator for host-resident state.
        """
        self._lay_out_in_place_state()
        for entry in self._entries.values():
            entry.settle()
        self._state_changes.parked.clear()

    def _lay_out_in_place_state(self):
        """Take the in-place moments home laid out for the flat in-place step (one block per
        run), where a client parked them on the host between training phases."""
        flat = self._flat_in_place_step()
        if flat is not None:
            flat.lay_out()

    @torch.no_grad()
    def _settle(self, inner, optimizer, live, key, value):
        """Return the tensor that keeps a loaded ``value`` for ``inner`` from now on: the live
        tensor, written in place, where one of the same size exists."""
        if not isinstance(value, torch.Tensor):
            return value
        if key == MASTER:
            if value is not inner:
                inner.copy_(value.reshape(inner.shape))
            return inner
        if isinstance(live, torch.Tensor) and live.numel() == value.numel():
            # A live tensor a client parked away from home is replaced, not written.
            if (live.device, live.dtype) == home_of(inner, optimizer, key, live):
                if live is not value:
                    live.copy_(value.reshape(live.shape))
                return live
        return placed(inner, optimizer, key, value)

    @torch.no_grad()
    def update_fp32_param_by_new_param(self):
        """Refresh every inner copy from its parameter after the parameters changed outside."""
        for param, inner in self.param_to_inner_param.items():
            if inner is not param:
                inner.copy_(param.detach().view_as(inner))

    # ------------------------------------------------------------------ checkpoints

    def _plan_load(self, state_dict) -> Dict[torch.Tensor, Dict[str, Any]]:
        """Check everything a load will write, changing nothing; return it per parameter
        (:func:`~megatron.core.optimizer.state_load_checks.plan_optimizer_state_dict`).

        The step and the master copies are no state every entry must hold: sub-optimizers of
        two kinds (TE FusedAdam in place, torch AdamW on the host) keep the step in different
        places. The optimizer's own tensors coming back (a reload of its own state dict, as
        the distributed optimizer does) were checked when they were loaded.

        Raises:
            KeyError, ValueError: naming the problem and the parameter's id in the checkpoint.
        """
        return checks.plan_optimizer_state_dict(
            state_dict,
            self.param_groups,
            f"{type(self).__name__}.load_state_dict",
            live_keys={k for e in self._entries.values() for k in e},
            optional_keys=(MASTER, "step"),
            own_tensors={id(v) for e in self._entries.values() for v in e.values()},
        )

    @staticmethod
    def _settle_loaded_state(self, state_dict):
        """Load pre-hook: plan, then write every entry where its inner tensor lives.

        The settled state is kept aside and torch is handed an empty one, so torch's own
        load never casts state onto the public parameters' device. From the first write on
        the optimizer is marked as loading; the post-hook clears the mark, so a load that
        fails in between leaves an optimizer that refuses to step or save.
        """
        self._ensure_built()
        planned, group_steps = plan_step_counts(
            self._plan_load(state_dict),
            state_dict["param_groups"],
            self.param_groups,
            lambda param: step_counter_of(self._owner[self.param_to_inner_param[param]]),
            f"{type(self).__name__}.load_state_dict",
        )
        self._load_guard.failure = "load_state_dict did not complete"
        flat = self._flat_in_place_step()
        if flat is not None:
            # Moments coming from elsewhere (a checkpoint read to the host) into an in-place
            # optimizer without state land in blocks laid out for the flat step, so that its
            # first step need not move them; moments already on the device are adopted as they
            # are, since a block beside them would hold them twice while the caller keeps them.
            flat.create_state(only={id(inner) for inner in self._coming_to_device(planned)})
        loaded = {}
        for param, values in planned.items():
            inner = self.param_to_inner_param[param]
            optimizer = self._owner[inner]
            live_state = optimizer.state.get(inner, {})
            loaded[param] = {
                key: self._settle(inner, optimizer, live_state.get(key), key, value)
                for key, value in values.items()
            }
        self._loaded_state = loaded
        groups = [
            {k: v for k, v in saved.items() if k not in _HDO_OPTIONS}
            for saved in state_dict["param_groups"]
        ]
        for index, step in group_steps.items():  # the post-hook hands them to the sub-groups
            if step is None:
                groups[index].pop("step", None)
            else:
                groups[index]["step"] = step
        return {**state_dict, "state": {}, "param_groups": groups}

    def _coming_to_device(self, planned) -> List[torch.Tensor]:
        """The inner tensors on an accelerator whose planned moments are all tensors elsewhere."""
        coming = []
        for param, values in planned.items():
            inner = self.param_to_inner_param[param]
            moments = [values.get(key) for key in MOMENT_NAMES]
            if all(isinstance(m, torch.Tensor) and m.device != inner.device for m in moments):
                coming.append(inner)
        return coming

    @staticmethod
    def _adopt_loaded_state(self):
        """Load post-hook: install the settled state into the same sub-optimizers."""
        loaded = self.__dict__.pop("_loaded_state", {})
        self.state = StateMap(self._entry_of)
        for param, entry in self._entries.items():
            values = loaded.get(param, {})
            values.pop(MASTER, None)  # already written into the inner tensor
            dict.clear(entry)
            dict.update(entry, values)
            dict.__setitem__(self._shared_sub_state(entry.optimizer), entry.inner, entry)
            self._list_entry(entry)
        self._state_changes.created.clear()
        self._state_changes.parked.clear()
        self._sync_hdo_param_groups_to_sub_optimizers()
        self._hand_back_group_steps()
        self._load_guard.failure = None

    @staticmethod
    def _refuse_after_a_failed_load(self):
        """State-dict pre-hook: a half-written state is not saved."""
        self._load_guard.check("save its state")

    @staticmethod
    def _state_as_plain_dicts(self, state_dict):
        """State-dict post-hook: each parameter's state as a plain dict of its own, so that a
        checkpoint holds no class of this module and later changes to it leave the live state
        alone."""
        state_dict["state"] = {key: dict(entry) for key, entry in state_dict["state"].items()}
        return state_dict

    def _register_load_state_dict_hooks(self):
        """Register the checkpoint hooks (once): loads cast each entry where its inner tensor
        lives, and saved state is made of plain dicts."""
        if getattr(self, "_checkpoint_hooks", None) is not None:
            return
        self._checkpoint_hooks = (
            self.register_load_state_dict_pre_hook(HybridDeviceOptimizer._settle_loaded_state),
            self.register_load_state_dict_post_hook(HybridDeviceOptimizer._adopt_loaded_state),
            self.register_state_dict_pre_hook(HybridDeviceOptimizer._refuse_after_a_failed_load),
            self.register_state_dict_post_hook(HybridDeviceOptimizer._state_as_plain_dicts),
        )

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

    def dummy_step(self):
        """Materialise the sub-optimizers' state without changing anything else.

        Each sub-optimizer takes a null step (zero gradients, learning rate and weight
        decay) on its parameters that have no state yet, then gets its counters and
        hyperparameters back: the result equals a never-stepped optimizer whose state
        tensors already exist, which is what an in-place checkpoint load needs. TE's moments
        are created laid out for the flat in-place step instead (zeros, as TE makes them).
        """
        self._ensure_built()
        flat = self._flat_in_place_step()
        if flat is not None:
            flat.create_state()  # laid out for the flat step; the null step skips it then
        for optimizer in self.sub_optimizers:
            materialise_by_null_step(optimizer)
        self._sync_sub_optimizers_state_to_hdo()
