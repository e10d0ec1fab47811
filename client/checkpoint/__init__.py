"""Sharded, atomic checkpoints that reshard to any world size (see ``paramplane.checkpoint.api``).

``save(state, path, group)``, ``save_async(...) -> SaveHandle``, ``load(state, path, group)``,
``latest(root)``, ``prune(root, keep)``; ``python -m paramplane.checkpoint inspect DIR`` and
``consolidate DIR out.npz``; ``sync(state, group, has_state=...)`` moves state live between ranks
(a replacement after ``World.reform()``), no disk.
"""

from __future__ import annotations

from paramplane.checkpoint.api import (
    CheckpointError,
    SaveFailed,
    SaveHandle,
    latest,
    load,
    prune,
    read_manifest,
    save,
    save_async,
)
from paramplane.checkpoint.live import sync

__all__ = [
    "CheckpointError",
    "SaveFailed",
    "SaveHandle",
    "latest",
    "load",
    "prune",
    "read_manifest",
    "save",
    "save_async",
    "sync",
]
