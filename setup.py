"""The build's one step that pyproject.toml cannot say: with ``CDC_RELAY_COMPILE=1`` the hot
path (cdc_relay/compiled.py, MODULES) is compiled with mypyc into a wheel for this platform and
Python; without it the package is pure Python. A compiled build type-checks those modules
against the runtime dependencies, so it runs without build isolation in an environment that
has them and mypy (``make dist-compiled``; docs/releasing.md, "The compiled build")."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup

ext_modules = []
if os.environ.get("CDC_RELAY_COMPILE") == "1":
    from mypyc.build import mypycify

    sys.path.insert(0, str(Path(__file__).parent))
    from cdc_relay.compiled import MODULES

    ext_modules = mypycify(list(MODULES), opt_level="3")

setup(ext_modules=ext_modules)
