"""torch FSDP1's static methods on pp.FSDP, for scripts (and libraries) written against ``FullyShardedDataParallel``:
``FSDP.state_dict_type`` (a context) / ``set_state_dict_type`` / ``get_state_dict_type``, the older optimizer-state API
(``full_optim_state_dict``, ``shard_full_optim_state_dict``, ``scatter_full_optim_state_dict``,
``rekey_optim_state_dict``), ``fsdp_modules``.

The full optimizer state dict is the one of ``optim_full.py`` (keyed by parameter name, as torch's); sharding
it for this rank is ``optim_state_dict_to_load``. ``scatter_full_optim_state_dict`` sends rank 0's dict to the
others as JSON (names, state names, dtypes, shapes, scalars, param groups) and arrays, never pickled.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from paramplane.checkpoint.agree import _gather_json
from paramplane.node.arrays import DTYPES, dtype_name, to_torch
from paramplane.parallel.fsdp import optim_full
from paramplane.parallel.torch_params import to_array

if TYPE_CHECKING:
    from paramplane.parallel.fsdp.wrapper import FSDP

__all__ = [
    "fsdp_modules",
    "full_optim_state_dict",
    "get_state_dict_type",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "set_state_dict_type",
    "shard_full_optim_state_dict",
    "state_dict_type",
]


def _fsdp(model: Any, call: str) -> FSDP:
    from paramplane.parallel.fsdp.wrapper import FSDP

    if not isinstance(model, FSDP):
        raise ValueError(f"FSDP.{call} takes the pp.FSDP wrapper, got {type(model).__name__}")
    return model


def _no_torch_only(call: str, **given: Any) -> None:
    named = sorted(k for k, v in given.items() if v is not None)
    if named:
        raise ValueError(
            f"FSDP.{call}: {', '.join(named)} not supported (optim_input is deprecated by torch: pass optim=; the "
            "group is the FSDP's own)"
        )


def fsdp_modules(module: Any, root_only: bool = False) -> list[FSDP]:
    """torch FSDP1's ``FSDP.fsdp_modules(module)``: the pp.FSDP itself (its units are not wrappers of their
    own), or none for anything else."""
    from paramplane.parallel.fsdp.wrapper import FSDP

    del root_only
    return [module] if isinstance(module, FSDP) else []


@contextlib.contextmanager
def state_dict_type(
    module: Any, state_dict_type: Any, state_dict_config: Any = None, optim_state_dict_config: Any = None
) -> Iterator[None]:
    """torch FSDP1's ``with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):`` around
    ``model.state_dict()``: the settings of ``set_state_dict_type`` inside, the ones before after. The full
    state is what ``state_dict()`` always gives (CPU tensors, on every rank: a ``rank0_only`` config's rank 0
    gets it as torch's does)."""
    before = _set(module, state_dict_type, state_dict_config, optim_state_dict_config, "state_dict_type")
    try:
        yield
    finally:
        module._state_dict_settings = before


def set_state_dict_type(
    module: Any, state_dict_type: Any, state_dict_config: Any = None, optim_state_dict_config: Any = None
) -> Any:
    """torch FSDP1's ``FSDP.set_state_dict_type``: only ``FULL_STATE_DICT`` (what ``state_dict()`` and
    ``FSDP.optim_state_dict`` always give; shards are ``sharded_state_dict()`` and ``pp.checkpoint``), else a
    ValueError. Returns the settings before, as torch's ``StateDictSettings``."""
    before = get_state_dict_type(module)
    _set(module, state_dict_type, state_dict_config, optim_state_dict_config, "set_state_dict_type")
    return before


def _set(module: Any, kind: Any, config: Any, optim_config: Any, call: str) -> Any:
    """Set the settings (FULL_STATE_DICT only: a ValueError naming what saves shards otherwise); returns what
    the wrapper held before (None: torch's defaults)."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictSettings

    fsdp = _fsdp(module, call)
    name = getattr(kind, "name", str(kind))
    if name != "FULL_STATE_DICT":
        raise ValueError(
            f"FSDP.{call}({name}): only FULL_STATE_DICT (state_dict()); shards are "
            "fsdp.sharded_state_dict() and pp.checkpoint.save({'model': fsdp}, ...)"
        )
    before = fsdp._state_dict_settings
    fsdp._state_dict_settings = StateDictSettings(
        kind,
        config if config is not None else FullStateDictConfig(),
        optim_config if optim_config is not None else FullOptimStateDictConfig(),
    )
    return before


def get_state_dict_type(module: Any) -> Any:
    """torch FSDP1's ``FSDP.get_state_dict_type``: the settings ``set_state_dict_type`` (or the
    ``state_dict_type`` context around the call) made; torch's default, ``FULL_STATE_DICT``, before."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictSettings,
        StateDictType,
    )

    settings = _fsdp(module, "get_state_dict_type")._state_dict_settings
    if settings is None:
        return StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
        )
    return settings


def full_optim_state_dict(
    model: Any, optim: Any, optim_input: Any = None, rank0_only: bool = True, group: Any = None
) -> dict[str, Any]:
    """torch FSDP1's older ``FSDP.full_optim_state_dict(model, optim)``: ``FSDP.optim_state_dict``'s dict (by
    parameter name), on group rank 0 only when ``rank0_only`` (torch's default; the others get ``{}``). A
    collective: every rank calls it."""
    fsdp = _fsdp(model, "full_optim_state_dict")
    _no_torch_only("full_optim_state_dict", optim_input=optim_input, group=group)
    full = optim_full.full_optim_state_dict(fsdp, optim)
    return full if not rank0_only or fsdp.group.rank == 0 else {}


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any], model: Any, optim_input: Any = None, optim: Any = None
) -> dict[str, Any]:
    """torch FSDP1's ``FSDP.shard_full_optim_state_dict(full_osd, model, optim=optim)``: this rank's part of a
    full optimizer state dict (from any world size or strategy) for ``optim.load_state_dict``. Without
    ``optim``, as torch, the optimizer is taken to step ``model.parameters()`` in one param group. No
    communication."""
    import torch

    fsdp = _fsdp(model, "shard_full_optim_state_dict")
    _no_torch_only("shard_full_optim_state_dict", optim_input=optim_input)
    if optim is None:  # torch's assumption: one param group over parameters(), in order
        optim = torch.optim.SGD(list(fsdp.parameters()), lr=0.0)
    return optim_full.optim_state_dict_to_load(fsdp, optim, full_optim_state_dict)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: Any,
    optim_input: Any = None,
    optim: Any = None,
    group: Any = None,
) -> dict[str, Any]:
    """torch FSDP1's ``FSDP.scatter_full_optim_state_dict(full_osd, model, optim=optim)``: group rank 0's full
    optimizer state dict (the others pass None) sent to every rank, then this rank's part of it, as
    ``shard_full_optim_state_dict``. A collective over the FSDP's group."""
    fsdp = _fsdp(model, "scatter_full_optim_state_dict")
    _no_torch_only("scatter_full_optim_state_dict", optim_input=optim_input, group=group)
    g = fsdp.group
    layout: Any = None
    arrays: list[np.ndarray] = []
    if g.rank == 0:  # a problem here is every rank's error (after the gather), not a hang of the others
        try:
            layout, arrays = _describe(full_optim_state_dict)
        except ValueError as exc:
            layout = {"error": str(exc)}
    layout = _gather_json(g, layout)[0]
    if "error" in layout:
        raise ValueError(layout["error"])
    state: dict[str, dict[str, Any]] = {}
    for i, (name, sname, kind, dtype, spec) in enumerate(layout["entries"]):
        if kind == "array":
            data = arrays[i] if g.rank == 0 else np.empty(spec, DTYPES[dtype])
            g.broadcast(data, src=0)
            value: Any = to_torch(data.copy() if g.rank == 0 else data)
        else:
            value = optim_full.scalar_value(kind, dtype, spec)
        state.setdefault(name, {})[sname] = value
    groups = [
        {k: tuple(v) if k in tuples else v for k, v in values.items()}
        for values, tuples in layout["param_groups"]
    ]
    return shard_full_optim_state_dict({"state": state, "param_groups": groups}, fsdp, optim=optim)


def _describe(full: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
    """JSON for ``full``'s layout and scalars (one entry per state value: name, state name, kind, dtype,
    shape or value; each param group's values and which of them are tuples), and each entry's array (aligned
    with the entries; a scalar's is empty). A ValueError for what JSON and arrays cannot carry."""
    import torch

    if not isinstance(full, dict) or not isinstance(full.get("state"), dict) or "param_groups" not in full:
        raise ValueError("FSDP.scatter_full_optim_state_dict: rank 0 passes what full_optim_state_dict gave")
    entries: list[list[Any]] = []
    arrays: list[np.ndarray] = []
    for name, states in full["state"].items():
        for sname, value in states.items():
            if torch.is_tensor(value) and value.dim() > 0:
                array = np.ascontiguousarray(to_array(value.detach().cpu(), f"{name}.{sname}"))
                entries.append([name, sname, "array", dtype_name(array.dtype), list(array.shape)])
                arrays.append(array)
                continue
            if torch.is_tensor(value) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                entries.append([name, sname, *optim_full.scalar_spec(value)])
            else:
                raise ValueError(
                    f"FSDP.scatter_full_optim_state_dict: {name!r} state {sname!r} is a {type(value).__name__}; "
                    "tensors and numbers only"
                )
            arrays.append(np.empty(0, np.uint8))
    groups = [
        [group, [k for k, v in group.items() if isinstance(v, tuple)]] for group in full["param_groups"]
    ]
    try:
        json.dumps(groups)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"FSDP.scatter_full_optim_state_dict: a param group holds {exc}") from None
    return {"entries": entries, "param_groups": groups}, arrays


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: Any,
    model: Any,
    optim_input: Any = None,
    optim: Any = None,
) -> dict[str, Any]:
    """torch FSDP1's ``FSDP.rekey_optim_state_dict``: an optimizer state dict keyed by parameter id (a plain
    optimizer's ``state_dict()``) re-keyed by name (``OptimStateKeyType.PARAM_NAME``), or back
    (``PARAM_ID``), for ``model`` (a plain torch module or a pp.FSDP: its module's parameter names). Ids are
    positions in ``optim``'s param groups, or in ``model.parameters()`` without it (torch's rule)."""
    _no_torch_only("rekey_optim_state_dict", optim_input=optim_input)
    from paramplane.parallel.fsdp.wrapper import FSDP

    module = model.module if isinstance(model, FSDP) else model
    name_of = {id(p): n for n, p in module.named_parameters()}
    params = (
        [p for g in optim.param_groups for p in g["params"]]
        if optim is not None
        else list(module.parameters())
    )
    names = [name_of.get(id(p)) for p in params]
    if None in names:
        raise ValueError(
            "FSDP.rekey_optim_state_dict: optim steps tensors that are not the model's parameters"
        )
    kind = getattr(optim_state_key_type, "name", str(optim_state_key_type))
    if kind == "PARAM_NAME":
        key: dict[Any, Any] = dict(enumerate(names))
    elif kind == "PARAM_ID":
        key = {n: i for i, n in enumerate(names)}
    else:
        raise ValueError(f"FSDP.rekey_optim_state_dict: unknown key type {optim_state_key_type!r}")
    wanted = set(key.values())

    def rekey(k: Any) -> Any:
        if k in key:
            return key[k]
        if k in wanted:  # already of the requested kind
            return k
        raise ValueError(f"FSDP.rekey_optim_state_dict: {k!r} names none of the model's parameters")

    return {
        "state": {rekey(k): v for k, v in optim_state_dict["state"].items()},
        "param_groups": [
            {**g, "params": [rekey(k) for k in g["params"]]} for g in optim_state_dict["param_groups"]
        ],
    }
