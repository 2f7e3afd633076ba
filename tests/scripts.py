"""The project's scripts/ and benchmarks/ as modules, for the tests that exercise them (neither is a package)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (ROOT / "scripts", ROOT / "benchmarks")


def load_script(name: str):
    """``scripts/<name>.py`` or ``benchmarks/<name>.py``, imported afresh as the module ``name``."""
    path = next(p for p in (f / f"{name}.py" for f in FOLDERS) if p.is_file())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
