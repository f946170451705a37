# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The fork's ``distrib_optimizer`` module offers everything megatron-core 0.19.2's does (CPU).

Upstream's module is loaded from the installed megatron-core under a private name and compared
with the module ``megatron.core`` resolves through the overlay:

* every public and single-underscore member of ``DistributedOptimizer`` and ``Range`` exists
  in the fork with the same kind (method, classmethod, staticmethod, property, class data) and
  the same ``inspect.signature`` (parameter names, kinds and defaults);
* every member upstream's class defines itself is defined by the fork's class or one of its
  mixins, not silently inherited from ``MixedPrecisionOptimizer``;
* every ``self.X = ...`` of upstream's class (parsed with ``ast``) is assigned somewhere in the
  source of the fork's class and mixins, and is not shadowed by a class-level descriptor;
* the module-level names other code imports from this module are there.

The last test (CUDA only) builds real instances through ``tools/distopt_resume.py`` and checks
that the fork's constructed optimizer carries upstream's instance attributes.
"""

import ast
import importlib
import importlib.util
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

# A vendored tree has neither the overlay package nor a copy of upstream's module to compare.
overlay = pytest.importorskip(
    "megatron_optimizer_fork", reason="the overlay package is not importable (vendored tree?)"
)

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

upstream_modules = optimizer_table.sibling("upstream_modules")

MODULE = "megatron.core.optimizer.distrib_optimizer"
REPO_ROOT = Path(__file__).resolve().parents[2]

# Names other code imports from this module, with where each use was found.
IMPORTED_MODULE_NAMES = {
    # megatron.core (optimizer, DDP, paged_stash), megatron.training, Megatron-LM's tests,
    # Megatron-Bridge, NeMo, MindSpeed patches.
    "DistributedOptimizer": "from ...distrib_optimizer import DistributedOptimizer",
    # Third-party range conversions and 0.19.2's own docs name it by this module.
    "Range": "megatron.core.optimizer.distrib_optimizer.Range",
    # Hugging Face accelerate imports MixedPrecisionOptimizer from this module.
    "MixedPrecisionOptimizer": "from ...distrib_optimizer import MixedPrecisionOptimizer",
    # Module flags that tests and downstream code read or patch.
    "HAVE_APEX_OR_TE": "module flag",
    "USING_TE_OPTIMIZER": "module flag",
    "USING_APEX_OPTIMIZER": "module flag",
}

# Members reached from outside the class that upstream sets or reads by name only
# (ChainedOptimizer sets ``_defer_param_sync`` on its DistributedOptimizers).
EXTERNALLY_SET_ATTRIBUTES = ("_defer_param_sync",)


def _fork_module_or_reason():
    """The module ``megatron.core`` resolves, or a reason why it cannot be compared."""
    if not overlay.is_active():
        return None, "the overlay is off (MEGATRON_OPTIMIZER_FORK=0 or not installed)"
    module = importlib.import_module(MODULE)
    if upstream_modules.is_upstreams(module):
        return None, "the fork ships no distrib_optimizer.py: megatron.core resolves upstream's"
    return module, None


UPSTREAM = upstream_modules.load()
FORK, FORK_MISSING = _fork_module_or_reason()
pytestmark = [
    pytest.mark.skipif(UPSTREAM is None, reason="no copy of megatron-core's own module"),
    pytest.mark.skipif(not overlay.is_active(), reason="the overlay is off"),
]
needs_fork = pytest.mark.skipif(FORK is None, reason=str(FORK_MISSING))


# ----------------------------------------------------------------------------- member helpers


def _kind(cls, name):
    """How ``name`` is defined on ``cls``: the descriptor type as seen through the MRO."""
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if isinstance(raw, property):
        return "property"
    if inspect.isfunction(raw):
        return "method"
    if callable(raw):
        return f"callable {type(raw).__name__}"
    return "data"


def _same_default(left, right):
    if left is right:
        return True
    if type(left) is not type(right):
        return False
    try:
        return bool(left == right)
    except Exception:  # pylint: disable=broad-except
        return repr(left) == repr(right)


def _signature_rows(obj):
    """(name, kind, default) of each parameter; the default as an object, compared by value."""
    return [
        (parameter.name, parameter.kind, parameter.default)
        for parameter in inspect.signature(obj).parameters.values()
    ]


def _signature_difference(expected, actual):
    """A readable description of how two callables' parameters differ, or None."""
    want, have = _signature_rows(expected), _signature_rows(actual)
    same = len(want) == len(have) and all(
        w[0] == h[0] and w[1] == h[1] and _same_default(w[2], h[2]) for w, h in zip(want, have)
    )
    if same:
        return None
    return f"upstream {inspect.signature(expected)} != fork {inspect.signature(actual)}"


# Bookkeeping every ABC subclass gets a private copy of; not part of the surface.
NOT_SURFACE = frozenset({"_abc_impl"})


def _compared_members(cls):
    """Public and single-underscore names on ``cls`` (inherited included), plus ``__init__``."""
    names = {name for name in dir(cls) if not name.startswith("__")} - NOT_SURFACE
    return sorted(names | {"__init__"})


def _surface_differences(upstream_cls, fork_cls):
    """Every missing member, changed kind, changed signature or changed class data value."""
    problems = []
    for name in _compared_members(upstream_cls):
        if not hasattr(fork_cls, name):
            problems.append(f"{name}: missing")
            continue
        want_kind, have_kind = _kind(upstream_cls, name), _kind(fork_cls, name)
        if want_kind != have_kind:
            problems.append(f"{name}: upstream {want_kind}, fork {have_kind}")
            continue
        if want_kind in ("method", "classmethod", "staticmethod"):
            difference = _signature_difference(getattr(upstream_cls, name), getattr(fork_cls, name))
            if difference:
                problems.append(f"{name}: {difference}")
        elif want_kind == "data":
            want, have = getattr(upstream_cls, name), getattr(fork_cls, name)
            if not _same_default(want, have):
                problems.append(f"{name}: upstream {want!r}, fork {have!r}")
    return problems


# ----------------------------------------------------------------------------- ast helpers


def _assigned_self_attributes(class_node):
    """{attribute: {method names}} for every ``self.X`` assignment target inside a class."""
    found = {}
    for method in class_node.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(method):
            if isinstance(node, ast.Assign):
                pending = list(node.targets)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                pending = [node.target]
            else:
                continue
            while pending:
                target = pending.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    pending.extend(target.elts)
                elif isinstance(target, ast.Starred):
                    pending.append(target.value)
                elif (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    found.setdefault(target.attr, set()).add(method.name)
    return found


def _class_node(path, class_name):
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return node
    raise LookupError(f"class {class_name} not found in {path}")


def upstream_attributes(class_name="DistributedOptimizer", only_init=False):
    """Attributes upstream's class assigns on ``self`` (only in ``__init__`` if asked)."""
    found = _assigned_self_attributes(_class_node(UPSTREAM.__file__, class_name))
    return sorted(name for name, where in found.items() if not only_init or "__init__" in where)


def _fork_own_classes(cls):
    """The classes of ``cls``'s MRO whose source lives in the fork's optimizer package."""
    fork_dir = Path(overlay.fork_package_dir("megatron.core.optimizer")).resolve()
    own = []
    for klass in cls.__mro__:
        try:
            source = Path(inspect.getsourcefile(klass)).resolve()
        except (TypeError, OSError):
            continue
        if fork_dir in source.parents:
            own.append((klass, source))
    return own


def _assigned_in_mro(cls):
    """Attributes assigned on ``self`` by ``cls`` or any class it inherits from.

    The base classes count: ``MegatronOptimizer.__init__`` already sets ``self.optimizer``,
    which upstream's class assigns a second time and the fork need not.
    """
    assigned = set()
    for klass in cls.__mro__[:-1]:
        try:
            node = _class_node(inspect.getsourcefile(klass), klass.__name__)
        except (TypeError, OSError, LookupError):
            continue
        assigned |= set(_assigned_self_attributes(node))
    return assigned


def _fork_source_text(cls):
    return "\n".join(source.read_text(encoding="utf-8") for _, source in _fork_own_classes(cls))


# ----------------------------------------------------------------------------- tests


def test_the_overlay_serves_the_forks_module():
    """megatron.core resolves the fork's file, and the package exports its class."""
    assert FORK is not None, FORK_MISSING
    fork_dir = Path(overlay.fork_package_dir("megatron.core.optimizer")).resolve()
    assert Path(FORK.__file__).resolve().parent == fork_dir
    # Code that imports the class through the package gets the same class object.
    package = importlib.import_module("megatron.core.optimizer")
    assert package.DistributedOptimizer is FORK.DistributedOptimizer


def test_the_ast_reader_sees_tuple_targets_and_every_method():
    """The parser behind the attribute checks finds every kind of ``self.X`` target."""
    # The parser decides what the attribute checks below demand; pin it on a known class.
    source = textwrap.dedent("""
        class Sample:
            def __init__(self):
                self.a = 1
                self.b, (self.c, other) = 2, (3, 4)
                self.d: int = 5
                self.a += 1
                other.e = 6
            def later(self):
                self.f = [7]
                self.f[0] = 8
        """)
    node = ast.parse(source).body[0]
    found = _assigned_self_attributes(node)
    assert sorted(found) == ["a", "b", "c", "d", "f"]
    assert found["f"] == {"later"} and found["a"] == {"__init__"}


def test_the_comparison_catches_each_kind_of_drift():
    """The member comparison reports missing members and changed kinds, signatures, data."""

    # pylint: disable=missing-class-docstring,missing-function-docstring,unused-argument
    class Reference:
        formats = {"a", "b"}

        def __init__(self, x, *, y=1):
            pass

        def method(self, a, b=2):
            pass

        @classmethod
        def build(cls, items):
            pass

        @staticmethod
        def helper(value, flag=False):
            pass

        @property
        def keys(self):
            return ()

    class Same(Reference):
        pass

    class Drifted:
        formats = {"a"}

        def __init__(self, x, y=1):
            pass

        def method(self, a, b=3):
            pass

        def build(self, items):
            pass

        @staticmethod
        def helper(value, other=False):
            pass

        keys = ()

    assert not _surface_differences(Reference, Same)
    problems = "\n".join(_surface_differences(Reference, Drifted))
    for name in ("__init__", "method", "build", "helper", "keys", "formats"):
        assert f"{name}:" in problems, (name, problems)

    class Missing:
        pass

    assert "method: missing" in _surface_differences(Reference, Missing)


def test_upstream_attribute_list_is_the_expected_size():
    """The parser finds upstream's well-known attributes (it must not silently find none)."""
    names = upstream_attributes(only_init=True)
    assert len(names) >= 20, names
    for name in ("optimizer", "gbuf_ranges", "model_param_gbuf_map", "opt_group_ranges"):
        assert name in names


@needs_fork
def test_distributed_optimizer_members_match_upstream():
    """Every member of upstream's class exists in the fork with the same kind and signature."""
    problems = _surface_differences(UPSTREAM.DistributedOptimizer, FORK.DistributedOptimizer)
    assert not problems, "\n".join(problems)


@needs_fork
def test_distributed_optimizer_keeps_upstreams_base_class():
    """isinstance checks against MixedPrecisionOptimizer keep holding."""
    from megatron.core.optimizer.optimizer import (  # pylint: disable=import-outside-toplevel
        MixedPrecisionOptimizer,
    )

    assert issubclass(UPSTREAM.DistributedOptimizer, MixedPrecisionOptimizer)
    assert issubclass(FORK.DistributedOptimizer, MixedPrecisionOptimizer)


@needs_fork
def test_members_upstream_overrides_are_overridden_by_the_fork():
    """What upstream's class defines itself, the fork defines too (not the base's version)."""
    from megatron.core.optimizer.optimizer import (  # pylint: disable=import-outside-toplevel
        MixedPrecisionOptimizer,
    )

    inherited = set(MixedPrecisionOptimizer.__mro__)
    owner_of = {}
    for klass in FORK.DistributedOptimizer.__mro__:
        for name in vars(klass):
            owner_of.setdefault(name, klass)
    overridden = [n for n in vars(UPSTREAM.DistributedOptimizer) if not n.startswith("__")]
    overridden.append("__init__")
    leaked = sorted(name for name in overridden if owner_of.get(name) in inherited)
    assert not leaked, f"upstream overrides these, the fork inherits them from the base: {leaked}"


@needs_fork
def test_class_data_of_upstream_is_kept():
    """The set of fully reshardable formats that ChainedOptimizer and training consult."""
    want = UPSTREAM.DistributedOptimizer.checkpoint_fully_reshardable_formats
    have = FORK.DistributedOptimizer.checkpoint_fully_reshardable_formats
    assert isinstance(have, set) and have == want


@needs_fork
def test_upstream_instance_attributes_are_assigned_by_the_fork():
    """Every ``self.X`` upstream assigns is assigned by the fork and not shadowed by the class."""
    wanted = upstream_attributes()
    assigned = _assigned_in_mro(FORK.DistributedOptimizer)
    missing = sorted(set(wanted) - assigned)
    assert not missing, f"never assigned on self by the fork's class, mixins or bases: {missing}"
    shadowed = sorted(
        name
        for name in wanted
        if name in dir(FORK.DistributedOptimizer) and name not in dir(UPSTREAM.DistributedOptimizer)
    )
    assert not shadowed, f"class-level names shadow upstream's instance attributes: {shadowed}"


@needs_fork
@pytest.mark.parametrize("name", EXTERNALLY_SET_ATTRIBUTES)
def test_externally_set_attributes_are_honoured(name):
    """ChainedOptimizer sets these on the instance; the fork must read them."""
    assert name in _fork_source_text(FORK.DistributedOptimizer)


@needs_fork
def test_range_members_match_upstream():
    """Range has upstream's members, signatures and instance attributes."""
    problems = _surface_differences(UPSTREAM.Range, FORK.Range)
    assert not problems, "\n".join(problems)
    assert upstream_attributes("Range", only_init=True) == ["end", "size", "start"]


@needs_fork
@pytest.mark.parametrize("start,end,shift", [(0, 0, 0), (3, 11, 0), (3, 11, 5), (7, 8, 2)])
def test_range_behaves_like_upstreams(start, end, shift):
    """Range's attributes, length, text forms and normalize agree with upstream's."""
    want, have = UPSTREAM.Range(start, end), FORK.Range(start, end)
    for name in upstream_attributes("Range", only_init=True):
        assert getattr(have, name) == getattr(want, name), name
    assert len(have) == len(want)
    assert str(have) == str(want) and repr(have) == repr(want)
    moved_want, moved_have = want.normalize(shift), have.normalize(shift)
    assert (moved_have.start, moved_have.end, moved_have.size) == (
        moved_want.start,
        moved_want.end,
        moved_want.size,
    )
    assert type(moved_have) is type(have)


@needs_fork
@pytest.mark.parametrize("name", sorted(IMPORTED_MODULE_NAMES))
def test_names_other_code_imports_are_there(name):
    """Module-level names other code imports from this module exist (flags keep their values)."""
    assert hasattr(FORK, name), f"{name} ({IMPORTED_MODULE_NAMES[name]})"
    want, have = getattr(UPSTREAM, name), getattr(FORK, name)
    if isinstance(want, bool):
        assert have is want
    elif name == "MixedPrecisionOptimizer":
        assert have is want


# ----------------------------------------------------------------------------- GPU check


def _load_resume_tool():
    path = REPO_ROOT / "tools" / "distopt_resume.py"
    spec = importlib.util.spec_from_file_location("distopt_resume_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_fork
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_constructed_instances_carry_upstreams_attributes(tmp_path):
    """Fork instances carry every attribute of upstream's ``__init__`` and of its instances.

    Without offload: 0.19.2's own HDO cannot step after a load with torch AdamW on both
    halves, so its offloaded run never gets as far as recording its attributes.
    """
    tool = _load_resume_tool()
    cases = [tool.Case(dtype="bf16", offload=0.0, fmt="dp_reshardable")]
    results = tool.drive(
        cases,
        pairs=[("fork", "fork"), ("fork", "upstream")],
        nproc=1,
        steps_before=1,
        steps_after=1,
        workdir=str(tmp_path),
    )
    init_attributes = set(upstream_attributes(only_init=True))
    for case in cases:
        fork_run = results[case.key(1, "fork", "fork")]
        upstream_run = results[case.key(1, "fork", "upstream")]
        assert fork_run.get("instance_attributes"), fork_run.get("error")
        assert upstream_run.get("instance_attributes"), upstream_run.get("error")
        have = set(fork_run["instance_attributes"])
        assert not init_attributes - have, sorted(init_attributes - have)
        missing = set(upstream_run["instance_attributes"]) - have
        assert not missing, sorted(missing)
