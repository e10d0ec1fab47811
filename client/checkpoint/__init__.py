"""Sharded, atomic checkpoints that reshard to any world size.

``save(state, path, group)``, ``save_async(...) -> SaveHandle``, ``load(state, path, group)``,
``latest(root)``, ``prune(root, keep)``; ``python -m paramplane.checkpoint inspect DIR`` and
``consolidate DIR out.npz``; ``sync(state, group, has_state=...)`` moves state live between ranks
(a replacement after ``World.reform()``), no disk.

A checkpoint is a directory on a filesystem every rank sees: one data file per rank holding what that rank
owns, and a ``manifest.json`` whose atomic rename commits it (a save killed half way leaves the previous
one as ``latest()``). The modules, one job each: ``flatten`` (state trees <-> named arrays), ``agree``
(what every rank must agree on before anything is written or modified), ``save`` (staging, ``save`` and
``save_async``), ``commit`` (the commit protocol: data files, per-rank lists, the manifest, failures),
``manifest`` (``read_manifest``, ``latest``, ``prune``), ``load`` (validation, then reading in place,
resharded), ``files`` (durable writes, failure reports, the verdict), ``reader`` (checked reads), ``live``
(``sync``).
"""

from __future__ import annotations

from paramplane.checkpoint.files import CheckpointError, SaveFailed
from paramplane.checkpoint.live import sync
from paramplane.checkpoint.load import load
from paramplane.checkpoint.manifest import latest, prune, read_manifest
from paramplane.checkpoint.save import SaveHandle, save, save_async

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
