"""Sharded, atomic checkpoints that reshard: ``save``, ``save_async``, ``load``, ``latest``, ``prune``.

A checkpoint is a directory on a filesystem every rank sees. Each rank writes only what it owns
(FSDP shards and optimizer-state shards; replicated state once, by the lowest group rank holding it, after
checking every rank holding it holds the same) into one data file,
``rank-<r>.data``: its pieces back to back as raw bytes, each at an offset aligned to 64 bytes,
written to a temporary name, fsynced once and renamed; then it fsyncs the directory and writes a
small ``.rank-<r>.json`` listing its pieces (key, flat range, file, byte offset, CRC32) and the
save's id (chosen by group rank 0 for this attempt; rank 0 first removes the lists, error reports,
data files and temporaries a crashed attempt left, and lists of another id never count). Group rank 0
waits for every rank's list, writes ``manifest.json`` (every array's global shape, dtype and the
pieces that hold it; plain values; who wrote it) to a temporary name, fsyncs it and renames it into
place: that rename commits the checkpoint.
A directory without a manifest is not a checkpoint, so a save killed half way leaves the previous
one as ``latest()``. A rank whose writing fails leaves ``.rank-<r>.error``; the other ranks' waits
see it and raise ``SaveFailed`` (a CheckpointError) naming that rank and its error at once.
A rank whose save fails (its own error, or SaveFailed, a timeout or a lost peer while waiting) removes
its data file, which nothing references, unless the save may still commit: a verdict file created
exclusively (``.verdict-<save id>``) decides between a rank giving up ("abort") and rank 0 about to
write the manifest ("commit"), and nothing is removed from a directory that holds a manifest.

Plain values are copied through JSON while staging, on every rank before any collective returns
(so ``save_async``'s caller may change them afterwards); one JSON cannot hold fails every rank with
CheckpointError naming the key. Numpy scalars (``np.float64(0.1)``) are plain values. The data files
hold raw bytes: the manifest's dtype (bfloat16 too) decides how they are read back, so every rank's
global shape and dtype of each key are compared while staging, and ranks that differ fail every rank
with CheckpointError naming the key, the ranks and what differs, before anything is written.

``load`` reads the manifest, checks every key, global shape and dtype on every rank, then each rank
validates the records of every key it loads and reads (``pread``, in chunks, nothing kept) and
CRC-checks every piece it will read and checks they are covered (a damaged record, a missing,
truncated or corrupted file, or any other problem on any rank, fails every rank before anything is
modified); then each rank reads those ranges in, straight into the target where it can, from
whichever pieces hold them, so a checkpoint written by N ranks loads on M. Nothing is memory-mapped:
a file cut short or a read error during the load is a CheckpointError naming the file, not a SIGBUS.
Arrays whose flat view is a copy (non-contiguous) are filled through a buffer copied back.
Checkpoints of format 1 (one ``.npy`` file per piece, records without an offset; bfloat16 stored as
same-size unsigned ints) load as before, read the same way after their header. Nothing is unpickled.

What ``state`` may hold: objects with ``sharded_state_dict()`` / ``load_sharded_state_dict()``
(``pp.FSDP``, ``pp.optim`` optimizers), objects with ``state_dict()`` / ``load_state_dict()``
(modules, ``pp.DDP``: replicated), and plain values (numbers, strings, lists, dicts, numpy arrays).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.checkpoint.files import (
    CheckpointError,
    SaveFailed,
    _check_failures,
    _data_file_name,
    _decide,
    _fsync_dir,
    _overrule,
    _raw,
    _Reader,
    _remove_leftovers,
    _report_failure,
    _verdict_path,
    _write_data_file,
    _write_json,
)
from paramplane.group import ProcessGroup
from paramplane.node.arrays import DTYPES, array_module, dtype_name, from_foreign, is_device, to_host
from paramplane.node.errors import CollectiveTimeout
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.torch_params import is_torch_module

MANIFEST = "manifest.json"
FORMAT = 2  # 2: one data file per rank, records with a byte offset; 1: one .npy file per piece
READABLE = (1, 2)
# Tests: "<rank>@<checkpoint folder name>" exits that rank after its shards of that save, before the commit.
_CRASH_ENV = "PARAMPLANE_TEST_CRASH_IN_SAVE"


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _leaf(value: Any) -> Any:
    """numpy, cupy and ShardedArray leaves as they are; a numpy scalar (``np.float64(0.1)``) as the plain
    Python value it holds (it cannot be loaded in place); any other ``__dlpack__`` tensor (torch, JAX) as a
    zero-copy numpy or cupy view, so that loading fills the caller's tensor in place."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, ShardedArray)) or is_device(value) or not hasattr(value, "__dlpack__"):
        return value
    if getattr(value, "requires_grad", False):  # a parameter: loaded in place like torch's load_state_dict
        value = value.detach()
    return from_foreign(value)[0]


def _entries(state: Mapping[str, Any]) -> dict[str, Any]:
    """Every leaf of ``state`` under ``top/key``: ShardedArray, whole array, or plain value."""
    out: dict[str, Any] = {}
    for top, obj in state.items():
        if "/" in top:
            raise ValueError(f"checkpoint keys may not contain '/': {top!r}")
        if hasattr(obj, "sharded_state_dict") and hasattr(obj, "load_sharded_state_dict"):
            leaves = obj.sharded_state_dict()
        elif (
            hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") and not hasattr(obj, "__dlpack__")
        ):
            leaves = obj.state_dict()
        else:
            out[top] = _leaf(obj)
            continue
        for key, value in leaves.items():
            out[f"{top}/{key}"] = _leaf(value)
    return out


def _as_sharded(value: Any) -> ShardedArray:
    """A whole array seen as the one piece that covers it."""
    if isinstance(value, ShardedArray):
        return value
    return _whole(value, value.reshape(-1))


def _flat_view(value: Any) -> Any | None:
    """The flat (1-D) view of an array leaf that writes through to it, or None when flattening it copies
    (a non-contiguous array: a transpose, a strided slice)."""
    if isinstance(value, ShardedArray):
        return value.local
    flags = getattr(value, "flags", None)
    return value.reshape(-1) if getattr(flags, "c_contiguous", False) else None


def _fill_leaf(fill: Fill, key: str, entry: dict[str, Any], target: Any) -> None:
    """``fill`` an array leaf in place: straight into its flat view, or through a buffer copied back."""
    if isinstance(target, ShardedArray):
        fill(key, entry, target)
        return
    flat = _flat_view(target)
    if flat is not None:
        fill(key, entry, _whole(target, flat))
        return
    buf = array_module(target).empty(int(target.size), target.dtype)
    fill(key, entry, _whole(target, buf))
    target[...] = buf.reshape(target.shape)


def _whole(target: Any, flat: Any) -> ShardedArray:
    return ShardedArray(tuple(int(d) for d in target.shape), 0, flat)


def _plain(key: str, value: Any) -> Any:
    """A deep copy of the plain value ``value`` through JSON (what the manifest will hold); ValueError naming
    ``key`` when JSON cannot hold it."""

    def scalar(obj: Any) -> Any:
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")

    try:
        return json.loads(json.dumps(value, default=scalar))
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"plain value {key!r} cannot be saved ({exc}): plain values must be JSON "
            "(numbers, strings, None, lists and dicts of them)"
        ) from None


def _gather_json(group: ProcessGroup, obj: Any) -> list[Any]:
    """Every group rank's ``obj`` (JSON), in group order."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = group.all_gather(np.array([data.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    every = group.all_gather(padded).reshape(group.size, -1)
    return [json.loads(bytes(every[r, : int(sizes[r])]).decode()) for r in range(group.size)]


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


def save_async(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    group: ProcessGroup,
    *,
    keep: int | None = None,
    _copy: bool = True,
) -> SaveHandle:
    """Stage ``state`` to host memory now and write it in a background thread (see the module docstring).

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
    arrays: dict[str, ShardedArray] = {}
    values: dict[str, Any] = {}
    problem = None
    try:
        for key, value in entries.items():
            if isinstance(value, ShardedArray) or _is_array(value):
                piece = _as_sharded(value)
                local = to_host(piece.local)  # a device array is copied here, a host one only when asked
                arrays[key] = ShardedArray(
                    piece.global_shape, piece.start, np.array(local) if _copy else local
                )
            else:
                values[key] = _plain(key, value)  # a deep copy: the caller may change it once we return
        kinds = {
            k: {"global_shape": list(a.global_shape), "dtype": dtype_name(a.dtype)} for k, a in arrays.items()
        }
        # Every rank offers every piece it holds; the lowest group rank that holds one writes it, so a key
        # only some ranks hold (a pipeline stage's) is saved too. Ranks offering the same piece (a whole array,
        # a replica's shard) must hold the same, as must ranks holding the same plain value (fingerprints and
        # digests, compared below): else the checkpoint would keep one rank's and load it everywhere. Module
        # buffers are the exception: replicas' may differ until the next forward re-broadcasts rank 0's.
        buffers = _buffer_keys(state)
        replicated = {
            _piece_name(k, a, entries[k]): _fingerprint(a.local)
            for k, a in arrays.items()
            if k not in buffers
        }
    except (ValueError, TypeError) as exc:
        problem, kinds, replicated = str(exc), {}, {}
    mine = [[k, a.start, a.stop] for k, a in arrays.items() if a.local.size]
    # Group rank 0 picks this attempt's id: only lists carrying it count (not those of a crashed attempt).
    # Every rank's kinds too: the data files hold raw bytes, so a rank staging another dtype or global shape
    # for a key would be read back as another rank's without a word.
    offer = {
        "pieces": mine,
        "problem": problem,
        "kinds": kinds,
        "replicated": replicated,
        "values": {k: _digest(v) for k, v in values.items()},
        "save_id": uuid.uuid4().hex if group.rank == 0 else None,
    }
    claimed = _gather_json(group, offer)
    failing: dict[str, list[int]] = {}
    for r, c in enumerate(claimed):
        if c["problem"]:
            failing.setdefault(c["problem"], []).append(r)
    texts = [f"group rank {', '.join(map(str, r))}: {p}" for p, r in failing.items()]
    texts += _kind_conflicts([c["kinds"] for c in claimed])
    texts += _replica_conflicts([c["replicated"] for c in claimed], "array")
    texts += _replica_conflicts([c["values"] for c in claimed], "value")
    if texts:
        raise CheckpointError(f"cannot save {target} (nothing was written): {'; '.join(texts)}")
    save_id: str = claimed[0]["save_id"]
    writer = _lowest_holders([[tuple(p) for p in c["pieces"]] for c in claimed])
    to_write = {k: a for k, a in arrays.items() if writer.get((k, a.start, a.stop)) == group.rank}
    value_owner = _lowest_holders([c["values"] for c in claimed])
    my_values = {k: v for k, v in values.items() if value_owner[k] == group.rank}
    every_kind = {k: kind for c in claimed for k, kind in c["kinds"].items()}  # agreed above
    if group.rank == 0:
        target.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(target)  # lists, errors, data files and temporaries of a crashed attempt
    group.barrier()
    meta = {"format": FORMAT, "world_size": group.size, "save_id": save_id, "arrays": every_kind}
    errors: list[BaseException] = []
    deadline = time.monotonic() + group.timeout
    tracer = group.tracer if hasattr(group.tracer, "mark") else None
    if tracer is not None:
        tracer.mark("checkpoint stage", staging, time.monotonic(), path=str(target))

    def write() -> None:
        start = time.monotonic()
        try:
            name, records = _data_file_name(group.rank), []
            if to_write:
                placed = _write_data_file(target / name, [piece.local for piece in to_write.values()])
                for (key, piece), (offset, crc) in zip(to_write.items(), placed, strict=True):
                    records.append(
                        {
                            "key": key,
                            "start": piece.start,
                            "stop": piece.stop,
                            "file": name,
                            "offset": offset,
                            "crc32": crc,
                        }
                    )
                _fsync_dir(target)  # the data file's name is durable before any list or the manifest
            if os.environ.get(_CRASH_ENV) == f"{group.rank}@{target.name}":
                os._exit(17)
            _write_json(
                target / f".rank-{group.rank}.json",
                {
                    "save_id": save_id,
                    "meta": meta if group.rank == 0 else None,
                    "values": my_values,
                    "pieces": records,
                },
            )
            if group.rank == 0:
                _commit(target, group, save_id, deadline, keep)
            else:
                _await(
                    target / MANIFEST,
                    target,
                    save_id,
                    deadline,
                    "the checkpoint's commit by group rank 0",
                    group,
                )
        except BaseException as exc:
            errors.append(exc)
            gave_up = _give_up(target, group.rank, save_id)
            if not isinstance(exc, SaveFailed):
                _report_failure(target, group.rank, save_id, exc)
            if gave_up:  # nothing will reference them: a full disk gets its space back
                for name in (_data_file_name(group.rank), f".rank-{group.rank}.json"):
                    try:
                        (target / name).unlink(missing_ok=True)
                    except OSError:
                        pass
        finally:
            if tracer is not None:
                tracer.mark("checkpoint write", start, time.monotonic(), path=str(target))

    thread = threading.Thread(target=write, name="paramplane-checkpoint", daemon=True)
    thread.start()
    return SaveHandle(target, thread, errors)


def _lowest_holders(held: Sequence[Iterable[Hashable]]) -> dict[Hashable, int]:
    """Each item -> the lowest group rank holding it (``held``: every rank's items, in group order)."""
    out: dict[Hashable, int] = {}
    for r, items in enumerate(held):
        for item in items:
            out.setdefault(item, r)
    return out


def _differing(held: Sequence[Mapping[str, Hashable]]) -> dict[str, dict[Any, list[int]]]:
    """Each key that group ranks hold with different contents (``held``: every rank's key -> content, in
    group order): content -> the ranks holding it."""
    seen: dict[str, dict[Any, list[int]]] = {}
    for r, mine in enumerate(held):
        for key, content in mine.items():
            seen.setdefault(key, {}).setdefault(content, []).append(r)
    return {key: by_content for key, by_content in seen.items() if len(by_content) > 1}


def _kind_conflicts(kinds: list[dict[str, Any]]) -> list[str]:
    """Each key that group ranks stage with different global shapes or dtypes (``kinds``: every rank's, in
    group order): the key, what differs, and which ranks have what."""
    out = []
    shaped = [{k: (tuple(kind["global_shape"]), kind["dtype"]) for k, kind in mine.items()} for mine in kinds]
    for key, by_kind in _differing(shaped).items():
        differs = [
            what
            for what, values in (
                ("global shape", {s for s, _ in by_kind}),
                ("dtype", {d for _, d in by_kind}),
            )
            if len(values) > 1
        ]
        held = "; ".join(
            f"{dtype} {shape} on group rank {', '.join(map(str, ranks))}"
            for (shape, dtype), ranks in by_kind.items()
        )
        out.append(f"{key!r} has a different {' and '.join(differs)} on different ranks: {held}")
    return out


def _buffer_keys(state: Mapping[str, Any]) -> set[str]:
    """The keys of module buffers in ``state`` (``top/name``; through wrappers' ``module``): a DDP replica's
    buffers (BatchNorm statistics) move with its own batches and are re-broadcast from group rank 0 at the
    next training forward, so they may differ between ranks; the lowest rank's copy is saved, as torch's."""
    out: set[str] = set()
    for top, obj in state.items():
        module = obj
        while module is not None and not hasattr(module, "named_buffers"):
            module = getattr(module, "module", None)
        if module is not None:
            try:
                out.update(f"{top}/{name}" for name, _ in module.named_buffers())
            except Exception:  # not a module after all: no buffers to allow for
                pass
    return out


def _piece_name(key: str, piece: ShardedArray, entry: Any) -> str:
    return f"{key}[{piece.start}:{piece.stop}]" if isinstance(entry, ShardedArray) else key


def _fingerprint(a: np.ndarray) -> str:
    """A checksum of ``a``'s bytes, sampled where it is large (up to 16 spread blocks of 64 KiB): what tells
    apart arrays that are not replicas at all (two pipeline stages saved under one key) without reading every
    replicated array on every rank; it does not prove replicas bit for bit equal."""
    raw = _raw(a)
    block = 1 << 16
    if raw.size <= 16 * block:
        return f"{raw.size}:{zlib.crc32(raw.data)}"
    crc = 0
    for start in np.linspace(0, raw.size - block, 16).astype(np.int64):
        crc = zlib.crc32(raw[start : start + block].data, crc)
    return f"{raw.size}:{crc}"


def _digest(value: Any) -> str:
    return hashlib.blake2s(json.dumps(value, sort_keys=True).encode(), digest_size=8).hexdigest()


def _replica_conflicts(held: list[dict[str, str]], what: str) -> list[str]:
    """Each key (or piece) that group ranks hold with different contents (``held``: every rank's fingerprints,
    in group order) although they hold it as replicas."""
    return [
        f"{what} {key!r} differs between group ranks "
        f"{' / '.join(', '.join(map(str, ranks)) for ranks in by_content.values())}, which hold it as replicas: "
        "a key that is not sharded (or a piece several ranks hold) must hold the same on every rank that has it; "
        "state that differs per rank (a pipeline stage's module and optimizer) needs keys of its own, e.g. "
        "{f'stage{stage}': module, f'optim{stage}': optimizer}"
        for key, by_content in _differing(held).items()
    ]


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


def save(
    state: Mapping[str, Any], path: str | os.PathLike[str], group: ProcessGroup, *, keep: int | None = None
) -> Path:
    """Save ``state`` to ``path`` (a new directory) and return it once committed on every rank.

    ``keep=K`` then deletes all but the K newest complete checkpoints next to it. Unlike ``save_async`` it
    writes the host arrays as they are, without a staging copy: the caller waits, so they do not change.
    """
    return save_async(state, path, group, keep=keep, _copy=False).wait()


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


def _commit(target: Path, group: ProcessGroup, save_id: str, deadline: float, keep: int | None) -> None:
    num_ranks = group.size
    lists = [
        _await(target / f".rank-{r}.json", target, save_id, deadline, f"group rank {r}'s shards", group)
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
    if _decide(target, save_id, "commit") != "commit":
        _check_failures(target, save_id)
        raise SaveFailed(f"saving {target} failed: a group rank gave it up before the commit")
    _write_json(target / MANIFEST, manifest)
    for r in range(num_ranks):
        (target / f".rank-{r}.json").unlink(missing_ok=True)
    _verdict_path(target, save_id).unlink(missing_ok=True)
    if keep is not None:
        prune(target.parent, keep)


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


def _saved_scalar(manifest: dict[str, Any], key: str) -> bool:
    """``key`` is a 0-d array in ``manifest``: what versions before numpy scalars became plain values saved."""
    saved = manifest["arrays"].get(key)
    return saved is not None and saved["global_shape"] == []


def _problems(
    entries: dict[str, Any], manifest: dict[str, Any], optim_tops: set[str]
) -> tuple[list[str], list[str]]:
    """Problems that forbid loading (nothing modified yet), and optimizer-state keys absent from the checkpoint."""
    problems, dropped = [], []
    saved_arrays, saved_values = manifest["arrays"], manifest["values"]
    tops = {k.split("/", 1)[0] for k in entries if "/" in k}
    for key, target in entries.items():
        if isinstance(target, ShardedArray) or _is_array(target):
            piece = _as_sharded(target)
            if key not in saved_arrays:
                if key.split("/", 1)[0] in optim_tops and key.split("/", 1)[1].startswith("state."):
                    dropped.append(key.split("/", 1)[1])
                    continue
                problems.append(f"missing key {key!r} (not in the checkpoint)")
                continue
            saved = saved_arrays[key]
            if tuple(saved["global_shape"]) != piece.global_shape:
                problems.append(
                    f"{key!r} has global shape {tuple(saved['global_shape'])} in the checkpoint, {piece.global_shape} here"
                )
            elif saved["dtype"] != dtype_name(piece.dtype):
                problems.append(
                    f"{key!r} is {saved['dtype']} in the checkpoint, {dtype_name(piece.dtype)} here"
                )
        elif key not in saved_values and "/" not in key and not _saved_scalar(manifest, key):
            problems.append(f"missing key {key!r} (not in the checkpoint)")
    extra = [
        k
        for k in [*saved_arrays, *saved_values]
        if "/" in k and k.split("/", 1)[0] in tops and k not in entries
    ]
    extra = [
        k for k in extra if not (k.split("/", 1)[0] in optim_tops and k.split("/", 1)[1].startswith("state."))
    ]
    problems += [
        f"unexpected key {k!r} (in the checkpoint, not in this state: a different model?)" for k in extra
    ]
    return problems, dropped


def _materialize(opt: Optimizer, top: str, manifest: dict[str, Any]) -> None:
    keys = opt.param_keys()
    for i, p in enumerate(opt.params):
        names = [keys[i]] + ([e.key for e in p.layout.entries] if p.layout is not None else [])
        prefixes = tuple(f"{top}/state.{n}." for n in names)
        arrays = {k.rsplit(".", 1)[1] for k in manifest["arrays"] if k.startswith(prefixes)}
        values = {k.rsplit(".", 1)[1]: v for k, v in manifest["values"].items() if k.startswith(prefixes)}
        if arrays or values:
            opt.ensure_state(i, arrays, values)


def _agree(group: ProcessGroup, problems: list[str], what: str) -> None:
    """Raise CheckpointError on every rank if any rank has a problem (before anything is modified)."""
    reports = _gather_json(group, problems[:5])
    failing = {r: p for r, p in enumerate(reports) if p}
    if failing:
        text = "; ".join(f"group rank {r}: {', '.join(p)}" for r, p in failing.items())
        raise CheckpointError(f"{what} (nothing was modified): {text}")


Fill = Callable[[str, dict[str, Any], ShardedArray], None]


def _prepare_optimizers(state: Mapping[str, Any], entries: dict[str, Any], manifest: dict[str, Any]) -> None:
    """A fresh optimizer gets (zero) state arrays for what ``manifest`` holds, added to ``entries`` to be filled."""
    for top, obj in state.items():
        if isinstance(obj, Optimizer):
            _materialize(obj, top, manifest)
            entries.update({f"{top}/{k}": v for k, v in obj.sharded_state_dict().items()})


def _apply(
    state: Mapping[str, Any],
    entries: dict[str, Any],
    manifest: dict[str, Any],
    dropped: list[str],
    fill: Fill,
) -> dict[str, Any]:
    """Fill every array of ``state`` with ``fill(key, manifest entry, target)`` and load the stateful
    objects; returns the plain values. Only after every rank agreed that ``manifest`` fits, and after
    ``_prepare_optimizers``."""
    loaded: dict[str, Any] = {}
    for key, target in entries.items():
        if isinstance(target, ShardedArray) or _is_array(target):
            if key in manifest["arrays"]:
                _fill_leaf(fill, key, manifest["arrays"][key], target)
            loaded[key] = target
        elif key in manifest["values"]:
            loaded[key] = manifest["values"][key]
        elif _saved_scalar(manifest, key):  # a numpy scalar that older versions saved as a 0-d array
            entry = manifest["arrays"][key]
            scalar = np.empty((), DTYPES[entry["dtype"]])
            fill(key, entry, ShardedArray((), 0, scalar.reshape(-1)))
            loaded[key] = scalar.item()
    result: dict[str, Any] = {}
    for top, obj in state.items():
        prefix = f"{top}/"
        mine = {k[len(prefix) :]: v for k, v in loaded.items() if k.startswith(prefix)}
        if isinstance(obj, Optimizer):
            values = {k[len(prefix) :]: v for k, v in manifest["values"].items() if k.startswith(prefix)}
            obj.load_sharded_state_dict({**mine, **values}, drop=dropped)
        elif hasattr(obj, "sharded_state_dict") and hasattr(obj, "load_sharded_state_dict"):
            obj.load_sharded_state_dict(mine)
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            if not is_torch_module(obj):  # a torch module's tensors were filled in place (DLPack views)
                obj.load_state_dict(mine)
        else:
            saved = loaded.get(top)
            result[top] = np.array(to_host(saved)) if _is_array(saved) else saved
    return result


def load(state: Mapping[str, Any], path: str | os.PathLike[str], group: ProcessGroup) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``state`` in place (any world size); returns the saved plain values.

    Every rank checks every key, and the files (checksums) and ranges it will read, first; a problem on any
    rank raises CheckpointError on every rank and nothing is modified.
    """
    root = Path(path)
    try:
        manifest: dict[str, Any] | None = read_manifest(root)
        local_error = ""
    except (OSError, ValueError) as exc:
        manifest, local_error = None, str(exc)
    entries = _entries(state)
    optim_tops = {top for top, obj in state.items() if isinstance(obj, Optimizer)}
    problems, dropped = (
        _problems(entries, manifest, optim_tops) if manifest is not None else ([local_error], [])
    )
    _agree(group, problems, f"cannot load {root}")
    assert manifest is not None
    optimizers = [obj for obj in state.values() if isinstance(obj, Optimizer)]
    fresh = [set(opt.state) for opt in optimizers]
    _prepare_optimizers(state, entries, manifest)
    # Every file this rank will read is opened and CRC-checked, and its ranges covered, before any rank
    # modifies anything: a damaged or missing file fails every rank, the fresh optimizer state is undone.
    with _Reader(root) as reader:  # every data file opened once, closed when the load ends or fails
        unreadable = []
        for key, target in entries.items():
            if _saved_scalar(manifest, key) and not (isinstance(target, ShardedArray) or _is_array(target)):
                unreadable.append(reader.check(key, manifest["arrays"][key], 0, 1))
            elif key in manifest["arrays"] and (isinstance(target, ShardedArray) or _is_array(target)):
                start, stop = (
                    (target.start, target.stop) if isinstance(target, ShardedArray) else (0, target.size)
                )
                unreadable.append(reader.check(key, manifest["arrays"][key], start, int(stop)))
        try:
            _agree(group, [p for p in unreadable if p is not None], f"cannot load {root}")
        except CheckpointError:
            for opt, had in zip(optimizers, fresh, strict=True):
                for index in set(opt.state) - had:
                    del opt.state[index]
            raise
        return _apply(state, entries, manifest, dropped, reader.fill)
