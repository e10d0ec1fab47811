"""The one way benchmarks report: JSON lines on stdout, appended to ``--out`` when given."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def emit(lines: Sequence[str], out: Path | None) -> None:
    print("\n".join(lines), flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write("\n".join(lines) + "\n")
