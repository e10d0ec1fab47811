"""The commit protocol: what each rank writes for a save, and how group rank 0 commits it.

Each rank writes only what it owns into one data file, ``rank-<r>.data``: its pieces back to back as raw
bytes, each at an offset aligned to 64 bytes, written to a temporary name, fsynced once and renamed; then
it fsyncs the directory and writes a small ``.rank-<r>.json`` listing its pieces (key, flat range, file,
byte offset, CRC32) and the save's id (chosen by group rank 0 for this attempt; rank 0 first removes the
lists, error reports, data files and temporaries a crashed attempt left, and lists of another id never
count). Group rank 0 waits for every rank's list, writes ``manifest.json`` to a temporary name, fsyncs it
and renames it into place: that rename commits the checkpoint.

A rank whose writing fails leaves ``.rank-<r>.error``; the other ranks' waits see it and raise
``SaveFailed`` (a CheckpointError) naming that rank and its error at once. A rank whose save fails (its
own error, or SaveFailed, a timeout or a lost peer while waiting) removes its data file, which nothing
references, unless the save may still commit: a verdict file created exclusively (``.verdict-<save id>``)
decides between a rank giving up ("abort") and rank 0 about to write the manifest ("commit"), and nothing
is removed from a directory that holds a manifest.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paramplane.checkpoint.files import (
    SaveFailed,
    _check_failures,
    _data_file_name,
    _decide,
    _fsync_dir,
    _overrule,
    _report_failure,
    _verdict_path,
    _write_data_file,
    _write_json,
)
from paramplane.checkpoint.manifest import MANIFEST, prune
from paramplane.group import ProcessGroup
from paramplane.node.errors import CollectiveTimeout
from paramplane.parallel.sharding import ShardedArray


@dataclass
class _SaveJob:
    """One rank's part of one save attempt, as every rank agreed while staging."""

    target: Path
    group: ProcessGroup
    save_id: str
    meta: dict[str, Any]  # format, world size, save id, every array's global shape and dtype
    pieces: dict[str, ShardedArray]  # the pieces this rank writes (the lowest rank holding each)
    values: dict[str, Any]  # the plain values this rank writes
    deadline: float  # time.monotonic() by which every wait gives up
    keep: int | None


def _write_and_commit(job: _SaveJob, errors: list[BaseException], tracer: Any) -> None:
    """A save's background part on one rank: its data file and list, then the commit (group rank 0) or the
    wait for it; what fails lands in ``errors`` and is cleaned up after."""
    start = time.monotonic()
    try:
        records = _write_pieces(job)
        rank = job.group.rank
        _write_json(
            job.target / f".rank-{rank}.json",
            {
                "save_id": job.save_id,
                "meta": job.meta if rank == 0 else None,
                "values": job.values,
                "pieces": records,
            },
        )
        if rank == 0:
            _commit(job)
            job.group.counters.checkpoint_committed(time.monotonic() - start)
        else:
            what = "the checkpoint's commit by group rank 0"
            _await(job.target / MANIFEST, job.target, job.save_id, job.deadline, what, job.group)
    except BaseException as exc:
        errors.append(exc)
        _clean_up(job, exc)
    finally:
        if tracer is not None:
            tracer.mark("checkpoint write", start, time.monotonic(), path=str(job.target))


def _write_pieces(job: _SaveJob) -> list[dict[str, Any]]:
    """This rank's data file (none when it writes no piece), durable; the records of its pieces."""
    if not job.pieces:
        return []
    name = _data_file_name(job.group.rank)
    placed = _write_data_file(job.target / name, [piece.local for piece in job.pieces.values()])
    records = [
        {"key": key, "start": piece.start, "stop": piece.stop, "file": name, "offset": offset, "crc32": crc}
        for (key, piece), (offset, crc) in zip(job.pieces.items(), placed, strict=True)
    ]
    _fsync_dir(job.target)  # the data file's name is durable before any list or the manifest
    return records


def _clean_up(job: _SaveJob, exc: BaseException) -> None:
    """After this rank's part failed: report it to the other ranks, and remove this rank's files when the
    save can no longer commit (nothing will reference them: a full disk gets its space back)."""
    rank = job.group.rank
    gave_up = _give_up(job.target, rank, job.save_id)
    if not isinstance(exc, SaveFailed):
        _report_failure(job.target, rank, job.save_id, exc)
    if gave_up:
        for name in (_data_file_name(rank), f".rank-{rank}.json"):
            try:
                (job.target / name).unlink(missing_ok=True)
            except OSError:
                pass


def _give_up(target: Path, rank: int, save_id: str) -> bool:
    """This rank's part of save ``save_id`` failed (its own error, or SaveFailed, a timeout or a lost peer
    while waiting): whether the save can no longer commit, so that this rank may remove its data file.
    Never once ``target`` holds a manifest; otherwise records the verdict "abort" unless group rank 0
    already recorded "commit" (then the manifest may be on its way), which rank 0 itself overrules when
    its commit failed before the manifest was in place."""
    if (target / MANIFEST).exists():
        return False
    try:
        verdict = _decide(target, save_id, "abort")
        if verdict == "commit" and rank == 0:
            _overrule(target, save_id)  # only rank 0 commits, and it did not
            verdict = "abort"
    except OSError:
        return False
    return verdict == "abort"


def _await(path: Path, target: Path, save_id: str, deadline: float, what: str, group: ProcessGroup) -> Any:
    """The JSON at ``path`` once it is there and belongs to this save (``save_id``); SaveFailed as soon as
    a rank reports a failure, PeerLost when a rank is lost, CollectiveTimeout at ``deadline``."""
    while True:
        _check_failures(target, save_id)
        if path.exists():
            try:
                found = json.loads(path.read_text())
            except (OSError, ValueError):
                found = None
            if isinstance(found, dict) and found.get("save_id") == save_id:
                return found
        group.check()  # a rank lost while saving fails the wait at once (PeerLost), not at the deadline
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"timed out waiting for {what} ({path}); a rank may have died or hung while saving"
            )
        time.sleep(0.01)


def _commit(job: _SaveJob) -> None:
    """Group rank 0: every rank's list of this save, then the manifest (the commit), then the lists and the
    verdict go, and ``keep`` prunes the older checkpoints."""
    target, num_ranks = job.target, job.group.size
    lists = [
        _await(
            target / f".rank-{r}.json",
            target,
            job.save_id,
            job.deadline,
            f"group rank {r}'s shards",
            job.group,
        )
        for r in range(num_ranks)
    ]
    meta = lists[0]["meta"]
    arrays = {k: dict(v, pieces=[]) for k, v in meta["arrays"].items()}
    values: dict[str, Any] = {}
    for listing in lists:
        values.update(listing["values"])  # each value from the lowest group rank holding it
        for rec in listing["pieces"]:
            arrays[rec.pop("key")]["pieces"].append(rec)
    manifest = {**meta, "values": values, "arrays": arrays, "saved_at": time.time()}
    # A rank that gave the save up in the meantime removes its data file: commit only if none did.
    if _decide(target, job.save_id, "commit") != "commit":
        _check_failures(target, job.save_id)
        raise SaveFailed(f"saving {target} failed: a group rank gave it up before the commit")
    _write_json(target / MANIFEST, manifest)
    for r in range(num_ranks):
        (target / f".rank-{r}.json").unlink(missing_ok=True)
    _verdict_path(target, job.save_id).unlink(missing_ok=True)
    if job.keep is not None:
        prune(target.parent, job.keep)
