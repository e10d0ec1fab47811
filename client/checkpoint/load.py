"""``load``: check a checkpoint against a state on every rank, then read it in place, resharded.

``load`` reads the manifest, checks every key, global shape and dtype on every rank, then each rank
validates the records of every key it loads and reads (``pread``, in chunks, nothing kept) and
CRC-checks every piece it will read and checks they are covered (a damaged record, a missing,
truncated or corrupted file, or any other problem on any rank, fails every rank before anything is
modified); then each rank reads those ranges in, straight into the target where it can, from
whichever pieces hold them, so a checkpoint written by N ranks loads on M. Nothing is memory-mapped:
a file cut short or a read error during the load is a CheckpointError naming the file, not a SIGBUS.
Checkpoints of format 1 (one ``.npy`` file per piece, records without an offset; bfloat16 stored as
same-size unsigned ints) load as before, read the same way after their header. Nothing is unpickled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.checkpoint.agree import _agree, _gather_json
from paramplane.checkpoint.files import CheckpointError
from paramplane.checkpoint.flatten import Fill, _as_sharded, _entries, _fill_leaf, _is_array
from paramplane.checkpoint.manifest import read_manifest
from paramplane.checkpoint.reader import _Reader
from paramplane.group import ProcessGroup
from paramplane.node.arrays import DTYPES, dtype_name, to_host
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.torch_params import is_torch_module


def _saved_scalar(manifest: dict[str, Any], key: str) -> bool:
    """``key`` is a 0-d array in ``manifest``: what versions before numpy scalars became plain values saved."""
    saved = manifest["arrays"].get(key)
    return saved is not None and saved["global_shape"] == []


def _is_optim_state(key: str, optim_tops: set[str]) -> bool:
    top, _, rest = key.partition("/")
    return top in optim_tops and rest.startswith("state.")


def _array_problem(key: str, piece: ShardedArray, saved: dict[str, Any]) -> str | None:
    if tuple(saved["global_shape"]) != piece.global_shape:
        return f"{key!r} has global shape {tuple(saved['global_shape'])} in the checkpoint, {piece.global_shape} here"
    if saved["dtype"] != dtype_name(piece.dtype):
        return f"{key!r} is {saved['dtype']} in the checkpoint, {dtype_name(piece.dtype)} here"
    return None


def _problems(
    entries: dict[str, Any], manifest: dict[str, Any], optim_tops: set[str]
) -> tuple[list[str], list[str], list[str]]:
    """Problems that forbid loading (nothing modified yet), optimizer-state keys absent from the checkpoint, and
    the checkpoint's keys under this state's objects that this rank does not load (unexpected, unless another
    rank loads them: each pipeline stage holds its own part of a model)."""
    problems: list[str] = []
    dropped: list[str] = []
    saved_arrays, saved_values = manifest["arrays"], manifest["values"]
    tops = {k.split("/", 1)[0] for k in entries if "/" in k}
    for key, target in entries.items():
        if isinstance(target, ShardedArray) or _is_array(target):
            piece = _as_sharded(target)
            if key in saved_arrays:
                problem = _array_problem(key, piece, saved_arrays[key])
                problems += [problem] if problem is not None else []
            elif _is_optim_state(key, optim_tops):
                dropped.append(key.split("/", 1)[1])
            else:
                problems.append(f"missing key {key!r} (not in the checkpoint)")
        elif key not in saved_values and "/" not in key and not _saved_scalar(manifest, key):
            problems.append(f"missing key {key!r} (not in the checkpoint)")
    extra = [
        k
        for k in [*saved_arrays, *saved_values]
        if "/" in k and k.split("/", 1)[0] in tops and k not in entries and not _is_optim_state(k, optim_tops)
    ]
    return problems, dropped, extra


def _unloaded(group: ProcessGroup, extra: list[str]) -> list[str]:
    """Problems for the checkpoint keys no rank of ``group`` loads (``extra``: those this rank does not)."""
    every = _gather_json(group, sorted(extra)) if group.size > 1 else [extra]
    nobody = set(every[0]).intersection(*every[1:])
    return [
        f"unexpected key {k!r} (in the checkpoint, loaded by no rank: a different model?)"
        for k in sorted(nobody)
    ]


def _materialize(opt: Optimizer, top: str, manifest: dict[str, Any]) -> None:
    keys = opt.param_keys()
    for i, p in enumerate(opt.params):
        names = [keys[i]] + ([e.key for e in p.layout.entries] if p.layout is not None else [])
        prefixes = tuple(f"{top}/state.{n}." for n in names)
        arrays = {k.rsplit(".", 1)[1] for k in manifest["arrays"] if k.startswith(prefixes)}
        values = {k.rsplit(".", 1)[1]: v for k, v in manifest["values"].items() if k.startswith(prefixes)}
        if arrays or values:
            opt.ensure_state(i, arrays, values)


def _prepare_optimizers(state: Mapping[str, Any], entries: dict[str, Any], manifest: dict[str, Any]) -> None:
    """A fresh optimizer gets (zero) state arrays for what ``manifest`` holds, added to ``entries`` to be filled."""
    for top, obj in state.items():
        if isinstance(obj, Optimizer):
            _materialize(obj, top, manifest)
            entries.update({f"{top}/{k}": v for k, v in obj.sharded_state_dict().items()})


def _fill_entries(entries: dict[str, Any], manifest: dict[str, Any], fill: Fill) -> dict[str, Any]:
    """Fill every array of ``entries`` the manifest holds; every loaded leaf (arrays and plain values)."""
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
    return loaded


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
    loaded = _fill_entries(entries, manifest, fill)
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


def _unreadable(reader: _Reader, entries: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """What is wrong with the records, files and ranges this rank will read (CRC-checked, nothing kept)."""
    found = []
    for key, target in entries.items():
        is_array = isinstance(target, ShardedArray) or _is_array(target)
        if _saved_scalar(manifest, key) and not is_array:
            found.append(reader.check(key, manifest["arrays"][key], 0, 1))
        elif key in manifest["arrays"] and is_array:
            start, stop = (
                (target.start, target.stop) if isinstance(target, ShardedArray) else (0, target.size)
            )
            found.append(reader.check(key, manifest["arrays"][key], start, int(stop)))
    return [p for p in found if p is not None]


def load(state: Mapping[str, Any], path: str | os.PathLike[str], group: ProcessGroup) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``state`` in place (any world size); returns the saved plain values.

    The ranks' states together must hold every key the checkpoint has under their objects; each rank reads only
    the keys its own state has (a pipeline stage loads its own parameters from a whole model's checkpoint).

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
    problems, dropped, extra = (
        _problems(entries, manifest, optim_tops) if manifest is not None else ([local_error], [], [])
    )
    problems += _unloaded(group, extra)
    _agree(group, problems, f"cannot load {root}")
    assert manifest is not None
    optimizers = [obj for obj in state.values() if isinstance(obj, Optimizer)]
    fresh = [set(opt.state) for opt in optimizers]
    _prepare_optimizers(state, entries, manifest)
    # Every file this rank will read is opened and CRC-checked, and its ranges covered, before any rank
    # modifies anything: a damaged or missing file fails every rank, the fresh optimizer state is undone.
    with _Reader(root) as reader:  # every data file opened once, closed when the load ends or fails
        try:
            _agree(group, _unreadable(reader, entries, manifest), f"cannot load {root}")
        except CheckpointError:
            for opt, had in zip(optimizers, fresh, strict=True):
                for index in set(opt.state) - had:
                    del opt.state[index]
            raise
        return _apply(state, entries, manifest, dropped, reader.fill)
