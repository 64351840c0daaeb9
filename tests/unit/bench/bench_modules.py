"""The bench/ scripts, imported by path: bench/ is a folder of scripts, not a package."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.helpers.repo import REPO


def bench_import(name: str) -> ModuleType:
    """A module of a package under bench/ (such as "sim.engine"), imported as a script there
    imports it."""
    if str(REPO / "bench") not in sys.path:
        sys.path.append(str(REPO / "bench"))
    return importlib.import_module(name)


def load_bench_module(name: str) -> ModuleType:
    """bench/<name>.py as a module; the scripts it imports come from bench/, as when run."""
    if str(REPO / "bench") not in sys.path:
        sys.path.append(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered as the script would be imported, so that its dataclasses resolve their
    # module and a process it spawns finds its functions by name.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
