# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Build script for megatron-core-optimizer-fork.

Project metadata lives in ``pyproject.toml``. This script only extends the ``build_py`` step so
that the wheel carries two extra things:

* a copy of the repository's ``megatron/core/optimizer/**/*.py`` files under
  ``megatron_optimizer_fork/_overlay/``, so nothing is ever installed into megatron-core's own
  ``megatron/`` folder (installing or uninstalling the fork leaves megatron-core's files alone);
* ``megatron_optimizer_fork.pth`` at the root of the wheel, so that it lands in site-packages
  and installs the import overlay at interpreter start.

It also keeps setuptools' ``*.egg-info`` folder inside ``build/``: left in the checkout's root,
it would answer ``importlib.metadata`` queries for this distribution in any interpreter started
from there, in place of the installed copy's metadata.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

HERE = os.path.dirname(os.path.abspath(__file__))
PTH_NAME = "megatron_optimizer_fork.pth"
OVERLAY_SOURCE = os.path.join("megatron", "core", "optimizer")
OVERLAY_TARGET = os.path.join("megatron_optimizer_fork", "_overlay")
EGG_BASE = "build"


def overlay_sources():
    """Lists the fork's module files to ship in the overlay.

    Returns:
        list[str]: Paths relative to the repository root, sorted, of every ``.py`` file below
        ``megatron/core/optimizer``.
    """
    found = []
    for folder, subfolders, files in os.walk(os.path.join(HERE, OVERLAY_SOURCE)):
        subfolders[:] = sorted(name for name in subfolders if name != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(folder, name), HERE))
    return found


class BuildPyWithOverlay(build_py):
    """``build_py`` that also stages the overlay tree and the start-up ``.pth`` file."""

    def run(self):
        """Builds the package, then copies the overlay files and the ``.pth`` into build_lib."""
        super().run()
        overlay_dir = os.path.join(self.build_lib, OVERLAY_TARGET)
        # An in-tree build reuses build/; drop files that left the repository since last time.
        if os.path.isdir(overlay_dir) and not self.dry_run:
            shutil.rmtree(overlay_dir)
        for source, target in self._extra_files():
            self.mkpath(os.path.dirname(target))
            self.copy_file(source, target, preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        """Adds the overlay files and the ``.pth`` to the files this step reports."""
        outputs = list(super().get_outputs(include_bytecode=include_bytecode))
        return outputs + [target for _, target in self._extra_files()]

    def _extra_files(self):
        """Pairs each extra source file with its destination inside build_lib."""
        pairs = [(os.path.join(HERE, PTH_NAME), os.path.join(self.build_lib, PTH_NAME))]
        for relative in overlay_sources():
            pairs.append(
                (
                    os.path.join(HERE, relative),
                    os.path.join(self.build_lib, OVERLAY_TARGET, relative),
                )
            )
        return pairs


class EggInfoInBuildDir(egg_info):
    """``egg_info`` that writes into ``build/`` unless a folder is given explicitly."""

    def initialize_options(self):
        """Defaults the metadata folder to ``build/``."""
        super().initialize_options()
        self.egg_base = EGG_BASE

    def finalize_options(self):
        """Creates the default metadata folder before setuptools checks that it exists."""
        if self.egg_base == EGG_BASE:
            os.makedirs(EGG_BASE, exist_ok=True)
        super().finalize_options()


setup(cmdclass={"build_py": BuildPyWithOverlay, "egg_info": EggInfoInBuildDir})
