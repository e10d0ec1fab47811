"""The committed checkpoints on disk: ``read_manifest``, ``latest``, ``prune``.

A checkpoint is a directory holding ``manifest.json`` (every array's global shape, dtype and the pieces
that hold it; plain values; who wrote it); a directory without one is not a checkpoint (a save killed half
way), so it never counts as ``latest()`` and ``prune`` leaves it alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from paramplane.checkpoint.files import CheckpointError

MANIFEST = "manifest.json"
FORMAT = 2  # 2: one data file per rank, records with a byte offset; 1: one .npy file per piece
READABLE = (1, 2)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``; FileNotFoundError when it is not a (complete) checkpoint."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MANIFEST}; an interrupted save?)")
    manifest: dict[str, Any] = json.loads(file.read_text())
    if manifest.get("format") not in READABLE:
        raise CheckpointError(
            f"{path}: checkpoint format {manifest.get('format')!r}, this paramplane reads "
            f"{', '.join(map(str, READABLE))}"
        )
    return manifest


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directly under ``root``, or None."""
    found = _complete(Path(root))
    return found[-1] if found else None


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if (d / MANIFEST).is_file():
            try:
                found.append((read_manifest(d)["saved_at"], d.name, d))
            except (ValueError, KeyError, OSError):
                continue
    return [d for _, _, d in sorted(found)]


def prune(root: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints under ``root``; returns what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    doomed = _complete(Path(root))[:-keep]
    for d in doomed:
        (d / MANIFEST).unlink()  # uncommit first: a crash mid-delete leaves no half checkpoint behind
        shutil.rmtree(d)
    return doomed
