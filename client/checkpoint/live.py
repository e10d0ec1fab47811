"""Live state transfer: ``sync(state, group, has_state=...)`` brings ranks without state (a replacement
after ``World.reform()``) to the state of a rank that has it, over the data plane, with no disk.

It takes the same ``state`` mapping as ``checkpoint.save`` / ``load`` (stateful objects and plain
values). The lowest group rank with ``has_state=True`` is the source: it describes its state (keys,
global shapes, dtypes, the range each array covers, plain values) in a JSON header broadcast to the
group; every rank checks that header against its own state exactly as ``load`` checks a manifest (any
problem fails every rank before anything is modified); then the arrays travel in one broadcast per
dtype (large arrays alone, straight into their target) and every other rank loads them in place. Nothing is unpickled.

The group's ranks must hold the same layout: replicas (``pp.DDP``, plain modules, optimizers over them)
over the world group, or, for sharded state, a group of ranks that hold the same shard ranges.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from paramplane.checkpoint.agree import _agree
from paramplane.checkpoint.files import CheckpointError
from paramplane.checkpoint.flatten import _as_sharded, _entries, _flat_view, _is_array
from paramplane.checkpoint.load import _apply, _prepare_optimizers, _problems
from paramplane.group import ProcessGroup
from paramplane.node.arrays import DTYPES, array_module, dtype_name, to_host
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.sharding import ShardedArray

_DIRECT_BYTES = (
    1 << 20
)  # arrays this large travel alone, into their target; smaller ones are packed per dtype


def _describe(entries: dict[str, Any]) -> dict[str, Any]:
    """The source's state as a manifest: arrays with the one range this rank holds, and plain values."""
    arrays: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for key, value in entries.items():
        if isinstance(value, ShardedArray) or _is_array(value):
            piece = _as_sharded(value)
            arrays[key] = {
                "global_shape": list(piece.global_shape),
                "dtype": dtype_name(piece.dtype),
                "pieces": [{"start": piece.start, "stop": piece.stop}],
            }
        else:
            values[key] = value
    return {"arrays": arrays, "values": values}


def _broadcast_json(group: ProcessGroup, obj: Any, src: int) -> Any:
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8) if group.rank == src else None
    size = np.array([0 if data is None else data.size], np.int64)
    group.broadcast(size, src=src)
    buf = np.zeros(int(size[0]), np.uint8) if data is None else data.copy()
    group.broadcast(buf, src=src)
    return json.loads(bytes(buf).decode())


def _layout_problems(entries: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    problems = []
    for key, target in entries.items():
        saved = manifest["arrays"].get(key)
        if saved is None or not (isinstance(target, ShardedArray) or _is_array(target)):
            continue
        piece, (src,) = _as_sharded(target), saved["pieces"]
        if (piece.start, piece.stop) != (src["start"], src["stop"]):
            problems.append(
                f"{key!r} covers elements [{piece.start}, {piece.stop}) here and [{src['start']}, {src['stop']}) "
                "on the source: sync needs ranks that hold the same layout (replicas)"
            )
    return problems


def _packing(manifest: dict[str, Any]) -> dict[str, list[tuple[str, int]]]:
    """dtype -> [(key, number of elements)] in one order every rank derives from the header."""
    order: dict[str, list[tuple[str, int]]] = {}
    for key in sorted(manifest["arrays"]):
        entry = manifest["arrays"][key]
        (piece,) = entry["pieces"]
        order.setdefault(entry["dtype"], []).append((key, piece["stop"] - piece["start"]))
    return order


def sync(state: Mapping[str, Any], group: ProcessGroup, *, has_state: bool) -> dict[str, Any]:
    """Give every rank of ``group`` the state of the lowest group rank that has it; returns the plain values.

    Every rank of the group calls it with the same ``state`` structure. Ranks with ``has_state=False``
    (a replacement) are overwritten in place, optimizer state included (a fresh optimizer gets it), and
    so are other ranks with state (replicas: they hold the same already); the source's state is untouched.
    CheckpointError on every rank when no rank has state or the source's state does not fit a rank's (a
    different model).
    """
    flags = group.all_gather(np.array([1 if has_state else 0], np.int64))
    holders = [r for r in range(group.size) if flags[r]]
    if not holders:
        raise CheckpointError("sync: no rank of the group has state (every rank passed has_state=False)")
    src = holders[0]
    entries = _entries(state)
    manifest = _broadcast_json(group, _describe(entries) if group.rank == src else None, src)
    optim_tops = {top for top, obj in state.items() if isinstance(obj, Optimizer)}
    problems, dropped, extra = _problems(entries, manifest, optim_tops)
    problems += [
        f"unexpected key {k!r} (in the sender's state, not in this one: a different model?)" for k in extra
    ]
    _agree(group, problems + _layout_problems(entries, manifest), f"cannot sync from group rank {src}")
    if group.rank == src:  # its state is the one sent: nothing to load
        _send(group, entries, manifest)
        return {
            top: np.array(to_host(v)) if _is_array(v) else v for top, v in entries.items() if top in state
        }
    _prepare_optimizers(state, entries, manifest)
    staged = _receive(group, src, entries, manifest)

    def fill(key: str, entry: dict[str, Any], target: ShardedArray) -> None:
        if key in staged:
            target.local[...] = array_module(target.local).asarray(staged[key])

    return _apply(state, entries, manifest, dropped, fill)


def _send(group: ProcessGroup, entries: dict[str, Any], manifest: dict[str, Any]) -> None:
    for dtype, keys in _packing(manifest).items():
        big = [k for k, n in keys if n * DTYPES[dtype].itemsize >= _DIRECT_BYTES]
        for key in big:
            group.broadcast(np.ascontiguousarray(to_host(_as_sharded(entries[key]).local)), src=group.rank)
        small = [k for k, n in keys if k not in big and n]
        if small:
            pieces = [np.asarray(to_host(_as_sharded(entries[k]).local)).reshape(-1) for k in small]
            group.broadcast(np.concatenate(pieces), src=group.rank)


def _receive(
    group: ProcessGroup, src: int, entries: dict[str, Any], manifest: dict[str, Any]
) -> dict[str, np.ndarray]:
    """Receive the source's arrays in ``_send``'s order: large ones straight into their target where it is a
    contiguous host array whose flat view writes through; the rest staged (returned by key) for ``_apply`` to
    copy in (``_apply`` copies non-contiguous targets back from a flat buffer)."""
    staged: dict[str, np.ndarray] = {}
    for dtype, keys in _packing(manifest).items():
        big = [k for k, n in keys if n * DTYPES[dtype].itemsize >= _DIRECT_BYTES]
        for key in big:
            local = _flat_view(entries[key])  # None where flattening copies (a non-contiguous target)
            if isinstance(local, np.ndarray) and local.flags.c_contiguous:
                group.broadcast(local, src=src)
            else:
                staged[key] = np.empty(dict(keys)[key], DTYPES[dtype])
                group.broadcast(staged[key], src=src)
        small = [(k, n) for k, n in keys if k not in big and n]
        if small:
            buf = np.empty(sum(n for _, n in small), DTYPES[dtype])
            group.broadcast(buf, src=src)
            offset = 0
            for key, n in small:
                staged[key] = buf[offset : offset + n]
                offset += n
    return staged
