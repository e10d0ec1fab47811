"""Sharded, atomic checkpoints that reshard: ``save``, ``save_async``, ``load``, ``latest``, ``prune``.

A checkpoint is a directory on a filesystem every rank sees. Each rank writes only what it owns
as ``.npy`` files (FSDP shards and optimizer-state shards, one file per piece; replicated state
once, by group rank 0), then a small ``.rank-<r>.json`` listing its pieces with a CRC32 each.
Group rank 0 waits for every rank's list, writes ``manifest.json`` (every array's global shape,
dtype and the flat ranges each file holds; plain values; who wrote it) to a temporary name,
fsyncs it and renames it into place: that rename commits the checkpoint. A directory without a
manifest is not a checkpoint, so a save killed half way leaves the previous one as ``latest()``.

``load`` reads the manifest, checks every key, global shape and dtype on every rank (any
problem fails every rank before anything is modified), then each rank reads only the ranges
it owns now, from whichever files hold them, so a checkpoint written by N ranks loads on M.
Nothing is unpickled: ``np.load(..., allow_pickle=False)``.

What ``state`` may hold: objects with ``sharded_state_dict()`` / ``load_sharded_state_dict()``
(``pp.FSDP``, ``pp.optim`` optimizers), objects with ``state_dict()`` / ``load_state_dict()``
(modules, ``pp.DDP``: replicated), and plain values (numbers, strings, lists, numpy arrays).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.node.arrays import array_module, dtype_name, from_foreign, is_device, to_host
from paramplane.node.errors import CollectiveTimeout
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.sharding import ShardedArray

MANIFEST = "manifest.json"
FORMAT = 1
# Tests: "<rank>@<checkpoint folder name>" exits that rank after its shards of that save, before the commit.
_CRASH_ENV = "PARAMPLANE_TEST_CRASH_IN_SAVE"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the state it is loaded into, or is damaged."""


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _leaf(value: Any) -> Any:
    """numpy, cupy and ShardedArray leaves as they are; any other ``__dlpack__`` tensor (torch, JAX) as a
    zero-copy numpy or cupy view, so that loading fills the caller's tensor in place."""
    if isinstance(value, (np.ndarray, ShardedArray)) or is_device(value) or not hasattr(value, "__dlpack__"):
        return value
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
    return ShardedArray(tuple(int(d) for d in value.shape), 0, value.reshape(-1))


def _file_name(key: str, start: int, stop: int) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key.replace("/", "__"))
    return f"{safe}.{start}-{stop}.npy"


def _gather_json(group: ProcessGroup, obj: Any) -> list[Any]:
    """Every group rank's ``obj`` (JSON), in group order."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = group.all_gather(np.array([data.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    every = group.all_gather(padded).reshape(group.size, -1)
    return [json.loads(bytes(every[r, : int(sizes[r])]).decode()) for r in range(group.size)]


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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
    state: Mapping[str, Any], path: str | os.PathLike[str], group: ProcessGroup, *, keep: int | None = None
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
    for key, value in entries.items():
        if isinstance(value, ShardedArray) or _is_array(value):
            piece = _as_sharded(value)
            arrays[key] = ShardedArray(piece.global_shape, piece.start, np.array(to_host(piece.local)))
        else:
            values[key] = value
    mine = [
        [k, a.start, a.stop]
        for k, a in arrays.items()
        if a.local.size and (isinstance(entries[k], ShardedArray) or group.rank == 0)
    ]
    claimed = _gather_json(group, mine)
    first: dict[tuple[str, int, int], int] = {}
    for r, pieces in enumerate(claimed):
        for k, a, b in pieces:
            first.setdefault((k, a, b), r)
    to_write = {k: a for k, a in arrays.items() if first.get((k, a.start, a.stop)) == group.rank}
    if group.rank == 0:
        target.mkdir(parents=True, exist_ok=True)
    group.barrier()
    meta = {
        "format": FORMAT,
        "world_size": group.size,
        "values": values,
        "arrays": {
            k: {"global_shape": list(a.global_shape), "dtype": dtype_name(a.dtype)} for k, a in arrays.items()
        },
    }
    errors: list[BaseException] = []
    deadline = time.monotonic() + group.timeout
    tracer = group.tracer if hasattr(group.tracer, "mark") else None
    if tracer is not None:
        tracer.mark("checkpoint stage", staging, time.monotonic(), path=str(target))

    def write() -> None:
        start = time.monotonic()
        try:
            records = []
            for key, piece in to_write.items():
                name = _file_name(key, piece.start, piece.stop)
                np.save(target / name, piece.local, allow_pickle=False)
                crc = _crc(piece.local)
                records.append(
                    {"key": key, "start": piece.start, "stop": piece.stop, "file": name, "crc32": crc}
                )
            if os.environ.get(_CRASH_ENV) == f"{group.rank}@{target.name}":
                os._exit(17)
            _write_json(
                target / f".rank-{group.rank}.json",
                {"meta": meta if group.rank == 0 else None, "pieces": records},
            )
            if group.rank == 0:
                _commit(target, group, deadline, keep)
            else:
                _wait_for(target / MANIFEST, deadline, "the checkpoint's commit by group rank 0", group)
        except BaseException as exc:
            errors.append(exc)
        finally:
            if tracer is not None:
                tracer.mark("checkpoint write", start, time.monotonic(), path=str(target))

    thread = threading.Thread(target=write, name="paramplane-checkpoint", daemon=True)
    thread.start()
    return SaveHandle(target, thread, errors)


def save(
    state: Mapping[str, Any], path: str | os.PathLike[str], group: ProcessGroup, *, keep: int | None = None
) -> Path:
    """Save ``state`` to ``path`` (a new directory) and return it once committed on every rank.

    ``keep=K`` then deletes all but the K newest complete checkpoints next to it.
    """
    return save_async(state, path, group, keep=keep).wait()


def _wait_for(path: Path, deadline: float, what: str, group: ProcessGroup) -> None:
    while not path.exists():
        group.check()  # a rank lost while saving fails the wait at once (PeerLost), not at the deadline
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"timed out waiting for {what} ({path}); a rank may have died while saving"
            )
        time.sleep(0.01)


def _commit(target: Path, group: ProcessGroup, deadline: float, keep: int | None) -> None:
    lists = []
    num_ranks = group.size
    for r in range(num_ranks):
        _wait_for(target / f".rank-{r}.json", deadline, f"group rank {r}'s shards", group)
        lists.append(json.loads((target / f".rank-{r}.json").read_text()))
    meta = lists[0]["meta"]
    arrays = {k: dict(v, pieces=[]) for k, v in meta["arrays"].items()}
    for listing in lists:
        for rec in listing["pieces"]:
            arrays[rec.pop("key")]["pieces"].append(rec)
    manifest = {**meta, "arrays": arrays, "saved_at": time.time()}
    _write_json(target / MANIFEST, manifest)
    for r in range(num_ranks):
        (target / f".rank-{r}.json").unlink(missing_ok=True)
    if keep is not None:
        prune(target.parent, keep)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``; FileNotFoundError when it is not a (complete) checkpoint."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MANIFEST}; an interrupted save?)")
    manifest: dict[str, Any] = json.loads(file.read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {manifest.get('format')!r}, this paramplane reads {FORMAT}"
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


class _Reader:
    """Opens each file once, checks its CRC32, and copies flat ranges out of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: dict[str, np.ndarray] = {}

    def array(self, rec: dict[str, Any]) -> np.ndarray:
        name = rec["file"]
        if name not in self._open:
            arr = np.load(self.root / name, mmap_mode="r", allow_pickle=False)
            if _crc(arr) != rec["crc32"]:
                raise CheckpointError(
                    f"{self.root / name} is corrupted: its CRC32 does not match the manifest"
                )
            self._open[name] = arr
        return self._open[name]

    def fill(self, key: str, entry: dict[str, Any], target: ShardedArray) -> None:
        covered = 0
        for rec in entry["pieces"]:
            lo, hi = max(rec["start"], target.start), min(rec["stop"], target.stop)
            if hi <= lo:
                continue
            src = self.array(rec)[lo - rec["start"] : hi - rec["start"]]
            dst = target.local[lo - target.start : hi - target.start]
            dst[...] = array_module(dst).asarray(src)
            covered += hi - lo
        if covered != target.stop - target.start:
            raise CheckpointError(
                f"{key!r}: the checkpoint holds {covered} of the {target.stop - target.start} elements this rank needs"
            )


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
        elif key not in saved_values and "/" not in key:
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
    for i, p in enumerate(opt.params):
        names = [p.name or str(i)] + ([e.key for e in p.layout.entries] if p.layout is not None else [])
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
                fill(key, manifest["arrays"][key], _as_sharded(target))
            loaded[key] = target
        elif key in manifest["values"]:
            loaded[key] = manifest["values"][key]
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
            obj.load_state_dict(mine)
        else:
            saved = loaded.get(top)
            result[top] = np.array(saved) if _is_array(saved) else saved
    return result


def load(state: Mapping[str, Any], path: str | os.PathLike[str], group: ProcessGroup) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``state`` in place (any world size); returns the saved plain values.

    Every rank checks every key first; a problem on any rank raises CheckpointError on every rank
    and nothing is modified.
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
    _prepare_optimizers(state, entries, manifest)
    return _apply(state, entries, manifest, dropped, _Reader(root).fill)
