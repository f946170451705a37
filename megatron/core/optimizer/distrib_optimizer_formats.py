# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The distributed optimizer's parameter-state formats, one object each, behind one registry.

A checkpoint's ``distrib_optim_sharding_type`` names a :class:`ParamStateFormat`. The format
says how the parameter state is described for a dist-checkpoint save or load
(:meth:`ParamStateFormat.describe`), how a loaded one is checked against the optimizer and
turned into a writer without writing anything (:meth:`ParamStateFormat.plan`), which public
loader of the optimizer writes it (``loader``: clients wrap these, so the load goes through
them), and the two facts the entry points need about it: whether the optimizer's common state
is saved independently of the data-parallel layout, and whether describing it for a save
gathers the whole state. ``sharded_state_dict`` and ``load_state_dict`` dispatch through
:data:`FORMATS` alone.

Each format's work lives with the optimizer's methods of upstream's names
(``sharded_param_state_<format>``, ``load_parameter_state_from_<format>``), which clients call
directly; the format objects name them and hold nothing else. They are looked up on the
optimizer instance at each call, so that a subclass's override or a client's wrapper of such a
method is what runs.
"""

from typing import Any, Callable, Dict, Optional

DP_RESHARDABLE = 'dp_reshardable'
DP_ZERO_GATHER_SCATTER = 'dp_zero_gather_scatter'
FULLY_RESHARDABLE = 'fully_reshardable'
FULLY_SHARDED_MODEL_SPACE = 'fully_sharded_model_space'
FSDP_DTENSOR = 'fsdp_dtensor'

DEFAULT_SHARDING_TYPE = FULLY_SHARDED_MODEL_SPACE
"""Format used when the metadata names none."""


class ParamStateFormat:
    """One parameter-state layout of a distributed-optimizer checkpoint.

    Attributes:
        name: the ``distrib_optim_sharding_type`` value.
        builder: the optimizer method describing the parameter state (``model_sharded_state_dict,
            is_loading, metadata``), or None where the format describes the whole state.
        planner: the optimizer method checking a loaded ``param_state`` and returning its
            writer, or None where ``load_state_dict`` cannot load the format.
        loader: the optimizer's public loader of a loaded ``param_state``.
        layout_free: the optimizer's common state is saved as plain values, independent of
            the data-parallel buffer layout (upstream's ``checkpoint_fully_reshardable_formats``).
        gathers: describing the format for a save gathers the whole state, which leaves large
            temporaries behind.
    """

    def __init__(
        self,
        name: str,
        builder: Optional[str],
        planner: Optional[str] = None,
        loader: Optional[str] = None,
        layout_free: bool = False,
        gathers: bool = False,
    ):
        self.name = name
        self.builder = builder
        self.planner = planner
        self.loader = loader
        self.layout_free = layout_free
        self.gathers = gathers

    @property
    def loadable(self) -> bool:
        """Whether ``load_state_dict`` loads this format's ``param_state``."""
        return self.planner is not None

    def describe(self, optimizer: Any, model_sharded_state_dict, is_loading: bool, metadata):
        """The format's ``param_state`` entry of ``optimizer``'s sharded state dict."""
        return getattr(optimizer, self.builder)(model_sharded_state_dict, is_loading, metadata)

    def plan(self, optimizer: Any, param_state) -> Callable[[], None]:
        """Check a loaded ``param_state`` against ``optimizer``; return what writes it.

        Raises:
            NotImplementedError: ``load_state_dict`` cannot load this format.
            ValueError, KeyError: the state does not fit the optimizer (nothing is written).
        """
        if not self.loadable:
            raise NotImplementedError(f'Unknown sharding_type: {self.name}')
        return getattr(optimizer, self.planner)(param_state)

    def load(self, optimizer: Any, param_state) -> None:
        """Load ``param_state`` through the optimizer's public loader of this format."""
        getattr(optimizer, self.loader)(param_state)

    def __repr__(self) -> str:
        return f"ParamStateFormat({self.name!r})"


FORMATS: Dict[str, ParamStateFormat] = {
    fmt.name: fmt
    for fmt in (
        ParamStateFormat(
            DP_ZERO_GATHER_SCATTER,
            'sharded_param_state_dp_zero',
            '_plan_dp_zero_gather_scatter_param_state',
            'load_parameter_state_from_dp_zero',
            gathers=True,
        ),
        ParamStateFormat(
            FULLY_RESHARDABLE,
            'sharded_param_state_fully_reshardable',
            '_plan_fully_reshardable_param_state',
            'load_parameter_state_from_fully_reshardable',
            layout_free=True,
            gathers=True,
        ),
        ParamStateFormat(
            DP_RESHARDABLE,
            'sharded_param_state_dp_reshardable',
            '_plan_dp_reshardable_param_state',
            'load_parameter_state_from_dp_reshardable',
        ),
        ParamStateFormat(
            FULLY_SHARDED_MODEL_SPACE,
            'sharded_param_state_fs_model_space',
            '_plan_fs_model_space_param_state',
            'load_parameter_state_from_fs_model_space',
            layout_free=True,
        ),
        # Megatron-FSDP's state is the inner optimizer's own, loaded by its own path.
        ParamStateFormat(FSDP_DTENSOR, None, layout_free=True),
    )
}
"""Every format, by name."""


def format_named(name: str) -> ParamStateFormat:
    """The format called ``name``.

    Raises:
        NotImplementedError: no such format (0.19.2 still recognised
            ``fully_sharded_bucket_space`` by name but could not build it either).
    """
    fmt = FORMATS.get(name)
    if fmt is None:
        raise NotImplementedError(f'Unknown sharding_type: {name}')
    return fmt


LAYOUT_FREE_FORMATS = {name for name, fmt in FORMATS.items() if fmt.layout_free}
"""Formats whose common state is saved without the data-parallel buffer layout."""
