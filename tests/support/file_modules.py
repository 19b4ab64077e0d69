"""Python files that are not importable by name — the benchmark scripts under benchmarks/, another
test file's helpers — loaded as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_module(path: Path, name: str) -> ModuleType:
    """The file at `path` as the module `name`, once per process: later calls get the same module
    (registered, so dataclasses and pickling resolve it)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_script(name: str) -> ModuleType:
    """benchmarks/NAME.py as the module NAME."""
    return load_module(BENCHMARKS / f"{name}.py", name)
