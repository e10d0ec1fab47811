"""``save`` and ``save_async``: stage a state to host memory, agree on it across the group, then write and
commit it in the background (the protocol is in ``commit``).

Each rank writes only what it owns (FSDP shards and optimizer-state shards; replicated state once, by the
lowest group rank holding it, after checking every rank holding it holds the same). Plain values are
copied through JSON while staging, on every rank before any collective returns (so ``save_async``'s caller
may change them afterwards); one JSON cannot hold fails every rank with CheckpointError naming the key.
The data files hold raw bytes: the manifest's dtype (bfloat16 too) decides how they are read back, so
every rank's global shape and dtype of each key are compared while staging, and ranks that differ fail
every rank with CheckpointError naming the key, the ranks and what differs, before anything is written.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.checkpoint.agree import (
    _check_offers,
    _digest,
    _fingerprint,
    _gather_json,
    _lowest_holders,
)
from paramplane.checkpoint.commit import _SaveJob, _write_and_commit
from paramplane.checkpoint.files import _remove_leftovers
from paramplane.checkpoint.flatten import _as_sharded, _buffer_keys, _entries, _is_array, _piece_name, _plain
from paramplane.checkpoint.manifest import FORMAT, MANIFEST
from paramplane.group import ProcessGroup
from paramplane.node.arrays import dtype_name, to_host
from paramplane.node.errors import CollectiveTimeout
from paramplane.parallel.sharding import ShardedArray


class SaveHandle:
    """A save in flight; ``wait()`` returns the committed directory or raises what failed."""

    def __init__(self, path: Path, thread: threading.Thread, errors: list[BaseException]) -> None:
        self.path = path
        self._thread = thread
        self._errors = errors

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CollectiveTimeout(f"checkpoint save to {self.path} not finished after {timeout} s")
        if self._errors:
            raise self._errors[0]
        return self.path


@dataclass
class _Staged:
    """One rank's state as host copies, and what it offers the other ranks to agree on."""

    arrays: dict[str, ShardedArray] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)  # JSON copies of the plain values
    kinds: dict[str, Any] = field(default_factory=dict)  # key -> global shape and dtype
    replicated: dict[str, str] = field(default_factory=dict)  # piece name -> fingerprint
    problem: str | None = None


def _stage(state: Mapping[str, Any], entries: dict[str, Any], copy: bool) -> _Staged:
    """Host copies of ``entries`` (a host array copied only when ``copy``); a staging problem is recorded,
    not raised, so that every rank learns of it."""
    staged = _Staged()
    try:
        for key, value in entries.items():
            if isinstance(value, ShardedArray) or _is_array(value):
                piece = _as_sharded(value)
                local = to_host(piece.local)  # a device array is copied here, a host one only when asked
                staged.arrays[key] = ShardedArray(
                    piece.global_shape, piece.start, np.array(local) if copy else local
                )
            else:
                staged.values[key] = _plain(
                    key, value
                )  # a deep copy: the caller may change it once we return
        staged.kinds = {
            k: {"global_shape": list(a.global_shape), "dtype": dtype_name(a.dtype)}
            for k, a in staged.arrays.items()
        }
        # Every rank offers every piece it holds; the lowest group rank that holds one writes it, so a key
        # only some ranks hold (a pipeline stage's) is saved too. Ranks offering the same piece (a whole array,
        # a replica's shard) must hold the same, as must ranks holding the same plain value (fingerprints and
        # digests, compared by every rank): else the checkpoint would keep one rank's and load it everywhere.
        # Module buffers are the exception: replicas' may differ until the next forward re-broadcasts rank 0's.
        buffers = _buffer_keys(state)
        staged.replicated = {
            _piece_name(k, a, entries[k]): _fingerprint(a.local)
            for k, a in staged.arrays.items()
            if k not in buffers
        }
    except (ValueError, TypeError) as exc:
        staged.problem, staged.kinds, staged.replicated = str(exc), {}, {}
    return staged


def _offer(staged: _Staged, group: ProcessGroup) -> dict[str, Any]:
    """What this rank tells the others. Group rank 0 picks this attempt's id: only lists carrying it count
    (not those of a crashed attempt)."""
    return {
        "pieces": [[k, a.start, a.stop] for k, a in staged.arrays.items() if a.local.size],
        "problem": staged.problem,
        "kinds": staged.kinds,
        "replicated": staged.replicated,
        "values": {k: _digest(v) for k, v in staged.values.items()},
        "save_id": uuid.uuid4().hex if group.rank == 0 else None,
    }


def _plan(
    staged: _Staged,
    claimed: list[dict[str, Any]],
    target: Path,
    group: ProcessGroup,
    deadline: float,
    keep: int | None,
) -> _SaveJob:
    """This rank's part of the save every rank agreed on (``claimed``: every rank's offer)."""
    save_id: str = claimed[0]["save_id"]
    writer = _lowest_holders([[tuple(p) for p in c["pieces"]] for c in claimed])
    value_owner = _lowest_holders([c["values"] for c in claimed])
    every_kind = {k: kind for c in claimed for k, kind in c["kinds"].items()}  # agreed already
    return _SaveJob(
        target=target,
        group=group,
        save_id=save_id,
        meta={"format": FORMAT, "world_size": group.size, "save_id": save_id, "arrays": every_kind},
        pieces={k: a for k, a in staged.arrays.items() if writer.get((k, a.start, a.stop)) == group.rank},
        values={k: v for k, v in staged.values.items() if value_owner[k] == group.rank},
        deadline=deadline,
        keep=keep,
    )


def save_async(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    group: ProcessGroup,
    *,
    keep: int | None = None,
    _copy: bool = True,
) -> SaveHandle:
    """Stage ``state`` to host memory now and write it in a background thread (see ``paramplane.checkpoint``).

    Collectives run before this returns (every rank calls it at the same point); the writing and the
    commit do not touch the data plane, so training may go on. Never exposes a half-written checkpoint.
    With ``PARAMPLANE_TRACE`` the trace shows both parts ("checkpoint stage", "checkpoint write").
    """
    target = Path(path)
    if (target / MANIFEST).exists():
        raise FileExistsError(f"{target} already holds a checkpoint; save to a new directory (e.g. step_N)")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    staging = time.monotonic()
    entries = _entries(state)
    staged = _stage(state, entries, _copy)
    claimed = _gather_json(group, _offer(staged, group))
    _check_offers(claimed, target)
    if group.rank == 0:
        target.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(target)  # lists, errors, data files and temporaries of a crashed attempt
    group.barrier()
    job = _plan(staged, claimed, target, group, time.monotonic() + group.timeout, keep)
    errors: list[BaseException] = []
    tracer = group.tracer if hasattr(group.tracer, "mark") else None
    if tracer is not None:
        tracer.mark("checkpoint stage", staging, time.monotonic(), path=str(target))
    thread = threading.Thread(
        target=_write_and_commit, args=(job, errors, tracer), name="paramplane-checkpoint", daemon=True
    )
    thread.start()
    return SaveHandle(target, thread, errors)


def save(
    state: Mapping[str, Any], path: str | os.PathLike[str], group: ProcessGroup, *, keep: int | None = None
) -> Path:
    """Save ``state`` to ``path`` (a new directory) and return it once committed on every rank.

    ``keep=K`` then deletes all but the K newest complete checkpoints next to it. Unlike ``save_async`` it
    writes the host arrays as they are, without a staging copy: the caller waits, so they do not change.
    """
    return save_async(state, path, group, keep=keep, _copy=False).wait()
