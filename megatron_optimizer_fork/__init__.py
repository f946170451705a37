# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Import overlay that serves the fork's optimizer modules from inside megatron-core.

The installed wheel holds a copy of the repository's ``megatron/core/optimizer`` tree under
``megatron_optimizer_fork/_overlay`` and a ``.pth`` file that calls :func:`install` when the
interpreter starts. The installed finder intercepts exactly two imports,
``megatron.core.optimizer`` and ``megatron.core.optimizer.cpu_offloading``: it lets the regular
path-based finder locate megatron-core's own package and then puts the fork's matching folder at
the front of the package's ``__path__``. Every submodule the fork ships therefore shadows
megatron-core's module of the same name, and every other submodule still comes from
megatron-core.

Set the environment variable ``MEGATRON_OPTIMIZER_FORK`` to ``0``, ``off``, ``false`` or ``no``
to switch the overlay off for a process. Nothing here imports torch or megatron at start-up.
"""

import importlib.machinery
import os
import sys

__all__ = [
    "ENV_VAR",
    "OVERLAID_PACKAGES",
    "SUPPORTED_MEGATRON_CORE",
    "ForkOverlayFinder",
    "fork_package_dir",
    "fork_root",
    "imported_megatron_core_version",
    "install",
    "installed_megatron_core_version",
    "is_active",
    "is_enabled",
    "load_upstream_module",
    "uninstall",
]

SUPPORTED_MEGATRON_CORE = "0.19.2"
"""The only megatron-core release whose optimizer package the fork is written against."""

ENV_VAR = "MEGATRON_OPTIMIZER_FORK"
"""Environment variable that switches the overlay off when set to a false-like value."""

_OFF_VALUES = frozenset({"0", "off", "false", "no"})

OVERLAID_PACKAGES = ("megatron.core.optimizer", "megatron.core.optimizer.cpu_offloading")
"""Dotted names of the packages whose ``__path__`` the overlay extends."""

_VERSION_CHECKED_PACKAGE = "megatron.core.optimizer"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# The checkout whose ``megatron/`` folder serve_from() chose for this process, if any.
_SERVED = {}


def is_enabled():
    """Tells whether the environment allows the overlay in this process.

    Returns:
        bool: False when ``MEGATRON_OPTIMIZER_FORK`` holds ``0``, ``off``, ``false`` or ``no``
        (in any letter case, surrounding blanks ignored); True otherwise, including when unset.
    """
    return os.environ.get(ENV_VAR, "").strip().lower() not in _OFF_VALUES


def fork_root():
    """Returns the folder that holds the fork's ``megatron/`` tree.

    An installed wheel keeps that tree in the ``_overlay`` folder next to this file. When this
    package is imported straight from a source checkout (which has no ``_overlay`` folder), the
    checkout's root is used instead.

    Returns:
        str: Absolute path of the folder that contains the fork's ``megatron`` folder.
    """
    if "root" in _SERVED:
        return _SERVED["root"]
    overlay = os.path.join(_PACKAGE_DIR, "_overlay")
    if os.path.isdir(overlay):
        return overlay
    checkout = os.path.dirname(_PACKAGE_DIR)
    if os.path.isfile(os.path.join(checkout, "pyproject.toml")) and os.path.isdir(
        os.path.join(checkout, "megatron", "core", "optimizer")
    ):
        return checkout
    return overlay


def serve_from(checkout):
    """Serves the fork's modules from the ``megatron/`` folder of another checkout in this
    process, so that one commit's code can be measured against another's (each in its own
    process). Modules imported before the call stay as they are: call it before anything
    imports ``megatron.core.optimizer``.

    Args:
        checkout (str): a folder holding ``megatron/core/optimizer``.

    Raises:
        ValueError: ``checkout`` holds no ``megatron/core/optimizer`` folder.
    """
    _SERVED["root"] = fork_checkout(checkout)


def fork_checkout(checkout):
    """Checks that a folder holds a fork's modules, as :func:`serve_from` needs, changing nothing.

    Args:
        checkout (str): a folder that should hold ``megatron/core/optimizer``.

    Returns:
        str: its absolute path.

    Raises:
        ValueError: ``checkout`` holds no ``megatron/core/optimizer`` folder.
    """
    root = os.path.abspath(checkout)
    if not os.path.isdir(os.path.join(root, "megatron", "core", "optimizer")):
        raise ValueError(f"{checkout}: no megatron/core/optimizer there")
    return root


def fork_package_dir(name):
    """Returns the fork's folder for one overlaid package.

    Args:
        name (str): Dotted package name, one of :data:`OVERLAID_PACKAGES`.

    Returns:
        str: Absolute path of the fork's folder for that package; it may not exist.
    """
    return os.path.join(fork_root(), *name.split("."))


def load_upstream_module(name):
    """Loads megatron-core's own copy of an overlaid module, beside the fork's.

    The overlay never touches ``megatron.core`` itself, so the file is found next to its
    ``__init__``. The module runs under a private name inside its own package (so its relative
    imports resolve) and is cached there; it never replaces the fork's module of the same name.
    Tests and benchmarks use it to compare the two.

    Args:
        name (str): Dotted module name, below ``megatron.core`` or in full, for example
            ``"optimizer.cpu_offloading.hybrid_optimizer"`` or
            ``"megatron.core.optimizer.distrib_optimizer"``.

    Returns:
        module: upstream's module object.
    """
    # pylint: disable=import-outside-toplevel
    import importlib
    import importlib.util

    import megatron.core

    relative = name[len("megatron.core.") :] if name.startswith("megatron.core.") else name
    package, _, leaf = f"megatron.core.{relative}".rpartition(".")
    private = f"{package}._upstream_{leaf}"
    if private in sys.modules:
        return sys.modules[private]
    importlib.import_module(package)
    path = os.path.join(os.path.dirname(megatron.core.__file__), *relative.split(".")) + ".py"
    spec = importlib.util.spec_from_file_location(private, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[private] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[private]
        raise
    return module


def installed_megatron_core_version():
    """Looks up the version of the installed megatron-core.

    The distribution's metadata is asked first. Only if it has none (a source checkout on the
    path, say) is ``megatron.core.package_info`` read; by then ``megatron.core`` is already being
    imported, so this costs no extra heavy import.

    Returns:
        str or None: The version string, or None when megatron-core cannot be found at all.
    """
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        pass
    try:
        from megatron.core import package_info  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    return getattr(package_info, "__version__", None)


def imported_megatron_core_version():
    """Reads the version of the megatron-core tree that ``import megatron.core`` resolved to.

    That tree is the one whose optimizer package the overlay would extend: a Megatron-LM
    checkout first on the path shadows the installed release. Its ``package_info`` (which
    ``megatron.core`` imports itself) answers, or that file read as text; without
    ``megatron.core`` imported, the installed distribution's metadata answers.

    Returns:
        tuple: ``(version or None, the tree's folder or None)``.
    """
    core = sys.modules.get("megatron.core")
    if core is None or not getattr(core, "__file__", None):
        return installed_megatron_core_version(), None
    folder = os.path.dirname(os.path.abspath(core.__file__))
    info = sys.modules.get("megatron.core.package_info")
    if getattr(info, "__version__", None):
        return info.__version__, folder
    import re  # pylint: disable=import-outside-toplevel

    try:
        with open(os.path.join(folder, "package_info.py"), encoding="utf-8") as source:
            text = source.read()
    except OSError:
        return installed_megatron_core_version(), folder
    fields = dict(
        re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([^'\"\s]*)", text, re.M)
    )
    if not {"MAJOR", "MINOR", "PATCH"} <= set(fields):
        return installed_megatron_core_version(), folder
    numbers = ".".join(fields[key] for key in ("MAJOR", "MINOR", "PATCH"))
    return numbers + fields.get("PRE_RELEASE", ""), folder


def _is_supported(version):
    """Tells whether a megatron-core version string matches the supported release.

    A local version label (``+gitsha``, as a source checkout reports) is ignored.
    """
    return version.split("+", 1)[0].strip() == SUPPORTED_MEGATRON_CORE


def _check_megatron_core_version():
    """Raises ImportError when the imported megatron-core is not the supported release."""
    version, folder = imported_megatron_core_version()
    if version is None or _is_supported(version):
        return
    where = f" at {folder}" if folder else ""
    raise ImportError(
        f"megatron-core-optimizer-fork supports megatron-core {SUPPORTED_MEGATRON_CORE} only, "
        f"but the megatron-core being imported{where} is {version}. Install megatron-core=="
        f"{SUPPORTED_MEGATRON_CORE} (or put its tree first on the path), vendor the fork into "
        f"that tree instead, or switch the optimizer fork's import overlay off by setting the "
        f"environment variable {ENV_VAR}=0 (or uninstall megatron-core-optimizer-fork)."
    )


class ForkOverlayFinder:
    """Meta path finder that puts the fork's folders first in two megatron-core packages.

    The finder never loads anything itself: it returns the spec that
    :class:`importlib.machinery.PathFinder` finds for megatron-core's own package, with the
    fork's folder inserted at the front of ``submodule_search_locations``. The package's own
    ``__init__`` then runs unchanged, and its relative imports already see the fork's modules.

    It implements the :class:`importlib.abc.MetaPathFinder` protocol without inheriting from
    that class on purpose: importing :mod:`importlib.abc` pulls in :mod:`importlib.resources`,
    :mod:`inspect` and :mod:`typing`, which would add tens of milliseconds to every interpreter
    start in the environment.
    """

    is_megatron_optimizer_fork_finder = True
    """Marker used to recognise an installed instance, even one from another copy of the class."""

    def find_spec(self, fullname, path, target=None):
        """Finds the spec of an overlaid package.

        Args:
            fullname (str): Dotted name of the module being imported.
            path (list or None): The parent package's ``__path__``.
            target (module or None): Module object being reloaded, if any.

        Returns:
            ModuleSpec or None: megatron-core's spec with the fork's folder first in its search
            locations, or None when the name is not overlaid, the overlay is switched off, or
            the package cannot be found.

        Raises:
            ImportError: When ``megatron.core.optimizer`` is imported beside a megatron-core
                release other than the supported one.
        """
        if fullname not in OVERLAID_PACKAGES or not is_enabled():
            return None
        if fullname == _VERSION_CHECKED_PACKAGE:
            _check_megatron_core_version()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None:
            return None
        locations = spec.submodule_search_locations
        fork_dir = fork_package_dir(fullname)
        if isinstance(locations, list) and os.path.isdir(fork_dir):
            known = {os.path.normcase(os.path.realpath(entry)) for entry in locations}
            if os.path.normcase(os.path.realpath(fork_dir)) not in known:
                locations.insert(0, fork_dir)
        return spec

    def invalidate_caches(self):
        """Nothing is cached here; the path-based finder keeps its own caches."""


def _installed_finders():
    """Returns the overlay finders currently in ``sys.meta_path``."""
    return [
        finder
        for finder in sys.meta_path
        if getattr(finder, "is_megatron_optimizer_fork_finder", False)
    ]


def install():
    """Installs the overlay finder at the front of ``sys.meta_path``.

    Calling it again is harmless: an already installed finder is kept and returned.

    Returns:
        ForkOverlayFinder: The finder in ``sys.meta_path``.
    """
    installed = _installed_finders()
    if installed:
        return installed[0]
    finder = ForkOverlayFinder()
    sys.meta_path.insert(0, finder)
    return finder


def uninstall():
    """Removes every overlay finder from ``sys.meta_path``.

    Modules that were already imported through the overlay stay as they are in
    ``sys.modules``.
    """
    for finder in _installed_finders():
        sys.meta_path.remove(finder)


def is_active():
    """Tells whether imports in this process go through the overlay.

    Returns:
        bool: True when the environment allows the overlay and its finder is installed.
    """
    return is_enabled() and bool(_installed_finders())
