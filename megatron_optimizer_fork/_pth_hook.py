# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Start-up hook run by ``megatron_optimizer_fork.pth`` from site-packages.

Importing this module installs the overlay finder. It only touches ``sys.meta_path``: neither
torch nor megatron is imported here, so every interpreter start stays cheap.
"""

from megatron_optimizer_fork import install

install()
