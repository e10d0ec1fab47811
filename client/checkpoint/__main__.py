"""``python -m paramplane.checkpoint inspect DIR`` and ``consolidate DIR OUT.npz``."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.checkpoint.flatten import _as_sharded
from paramplane.checkpoint.manifest import read_manifest
from paramplane.checkpoint.reader import _Reader
from paramplane.node.arrays import DTYPES


def inspect(path: Path) -> int:
    m = read_manifest(path)
    total = sum(math.prod(a["global_shape"]) * DTYPES[a["dtype"]].itemsize for a in m["arrays"].values())
    files = {rec["file"] for a in m["arrays"].values() for rec in a["pieces"]}
    print(
        f"checkpoint {path}: written by {m['world_size']} ranks, {len(m['arrays'])} arrays ({total / 1e6:.1f} MB) "
        f"in {len(files)} files, {len(m['values'])} values"
    )
    for key, a in sorted(m["arrays"].items()):
        print(f"  {key}: {a['dtype']} {tuple(a['global_shape'])} in {len(a['pieces'])} piece(s)")
    for key, value in sorted(m["values"].items()):
        print(f"  {key} = {value!r}")
    return 0


def consolidate(path: Path, out: Path) -> int:
    """Every array whole, in one ``.npz`` (checksums verified); plain values are printed, not stored.

    Arrays of a dtype ``.npz`` cannot hold (bfloat16) are stored as float32, which holds them exactly."""
    m = read_manifest(path)
    reader = _Reader(path)
    arrays = {}
    widened = []
    for key, a in m["arrays"].items():
        full = np.empty(tuple(a["global_shape"]), DTYPES[a["dtype"]])
        reader.fill(key, a, _as_sharded(full))
        if full.dtype.kind not in "biufc":
            widened.append(key)
            full = full.astype(np.float32)
        arrays[key] = full
    savez: Any = np.savez  # numpy's stub types **kwds as its keyword options
    savez(out, **arrays)
    print(f"wrote {len(arrays)} arrays to {out}")
    if widened:
        print(f"stored as float32 (exactly; .npz has no such dtype): {', '.join(sorted(widened))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paramplane.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="print the manifest summary").add_argument("path", type=Path)
    c = sub.add_parser("consolidate", help="write a single-file full state dict (.npz)")
    c.add_argument("path", type=Path)
    c.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        return inspect(args.path) if args.command == "inspect" else consolidate(args.path, args.out)
    except (OSError, ValueError) as exc:
        print(f"paramplane.checkpoint: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
