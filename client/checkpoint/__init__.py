"""Sharded, atomic checkpoints that reshard to any world size (see ``paramplane.checkpoint.api``).

``save(state, path, group)``, ``save_async(...) -> SaveHandle``, ``load(state, path, group)``,
``latest(root)``, ``prune(root, keep)``; ``python -m paramplane.checkpoint inspect DIR`` and
``consolidate DIR out.npz``.
"""

from __future__ import annotations

from paramplane.checkpoint.api import (
    CheckpointError,
    SaveHandle,
    latest,
    load,
    prune,
    read_manifest,
    save,
    save_async,
)

__all__ = ["CheckpointError", "SaveHandle", "latest", "load", "prune", "read_manifest", "save", "save_async"]
