"""``paramplane bench NAME [ARGS]``: run a benchmark from the repository's benchmarks/ folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(importlib.import_module("paramplane.benchmarks").__file__ or "").resolve().parent


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    available = (
        sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_"))
        if BENCHMARKS.is_dir()
        else []
    )
    if not args or args[0] in ("-h", "--help"):
        print(
            "usage: paramplane bench NAME [ARGS ...]\n\nbenchmarks: " + (", ".join(available) or "none found")
        )
        return 0 if args else 2
    name = args[0]
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        print(
            f"paramplane bench: no benchmark {name!r} in {BENCHMARKS} (available: {', '.join(available) or 'none'}); "
            "benchmarks run from a source checkout (pip install -e .)",
            file=sys.stderr,
        )
        return 2
    spec = importlib.util.spec_from_file_location(f"paramplane_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return int(module.main(args[1:]) or 0)
