"""A script of benchmarks/ loaded as a module, for the tests that check one without a GPU: the scripts are not a
package (each runs as `python benchmarks/NAME.py`), so they are imported by path, with benchmarks/ on sys.path for
the siblings some of them import."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py, executed afresh as module NAME (registered in sys.modules, where a dataclass in it looks
    its module up)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
