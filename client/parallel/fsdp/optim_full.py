"""torch FSDP1's full optimizer state dict over pp.FSDP's shards: ``FSDP.optim_state_dict(model, optim)`` and
``FSDP.optim_state_dict_to_load(model, optim, osd)``.

A torch optimizer under pp.FSDP steps flat shards (or, with ``use_orig_params``, pieces of parameters), so its
``state_dict()`` holds shard-shaped tensors under integer ids that mean nothing outside this world. The full
form is torch's: ``{"state": {name: {"exp_avg": tensor shaped like the parameter, "step": ...}},
"param_groups": [{"lr": ..., "params": [name, ...]}]}``, keyed by the module's parameter names, the same on
every rank, loadable at another world size or strategy (``optim_state_dict_to_load`` cuts this rank's pieces
out of it) and readable by a plain script. ``pp.checkpoint`` of ``fsdp.optim_state(opt)`` is the sharded,
scalable save; this is the one torch FSDP1 scripts write with ``torch.save``.

Building it is a collective over the FSDP's shard group: the ranks agree on the parameters and state names
(a rank may hold no piece of a parameter), then each full state tensor is every rank's pieces summed into
zeros (pieces never overlap within a shard group; replicas of a hybrid or no_shard world hold equal ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from paramplane.checkpoint.agree import _gather_json
from paramplane.node.arrays import array_module, to_host, to_torch
from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.torch_params import to_array

if TYPE_CHECKING:
    from paramplane.parallel.fsdp.wrapper import FSDP

Cut = Callable[[Any], dict[str, ShardedArray]]


def _stepped(fsdp: FSDP, optimizer: Any, call: str) -> list[tuple[int, Any, Cut]]:
    """(param group index, tensor, cut) for each of the FSDP's optimizer slots that ``optimizer`` steps."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"FSDP.{call} takes a torch.optim optimizer, got {type(optimizer).__name__}")
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    slots = [(group_of[id(t)], t, cut) for t, cut in fsdp.optim_slots() if id(t) in group_of]
    if not slots:
        raise ValueError(f"FSDP.{call}: the optimizer steps none of this FSDP's parameters")
    return slots


def _names(tensor: Any, cut: Cut) -> list[str]:
    """The module parameters ``tensor`` holds pieces of."""
    return list(cut(np.empty(int(tensor.numel()), np.uint8)))


def _module_order(fsdp: FSDP) -> list[str]:
    """Parameter names in the module's own order (``named_parameters``), as a plain optimizer lists them."""
    module = fsdp.module
    if hasattr(module, "named_parameters"):
        return [name for name, _ in module.named_parameters()]
    return [n for u in fsdp.units for n in u.names]


def _is_per_element(value: Any, tensor: Any) -> bool:
    return hasattr(value, "shape") and tuple(value.shape) == tuple(tensor.shape) and value.dim() > 0


def scalar_spec(value: Any) -> list[Any]:
    """A scalar optimizer state value (a 0-d tensor or a number: a step count) as JSON: [kind, dtype, value]."""
    import torch

    if torch.is_tensor(value):
        return ["tensor", str(value.dtype).removeprefix("torch."), float(value)]
    return ["number", type(value).__name__, float(value)]


def scalar_value(kind: str, dtype: str, value: float) -> Any:
    """What ``scalar_spec`` described, again: a 0-d tensor of its dtype, or an int or a float."""
    import torch

    if kind == "tensor":
        return torch.tensor(value, dtype=getattr(torch, dtype))
    return int(value) if dtype == "int" else value


def full_optim_state_dict(fsdp: FSDP, optimizer: Any) -> dict[str, Any]:
    """torch's full optimizer state dict keyed by parameter name (module docstring); CPU tensors, on every
    rank. A collective over ``fsdp.shard_group``: every rank calls it."""
    slots = _stepped(fsdp, optimizer, "optim_state_dict")
    pieces: list[tuple[str, str, ShardedArray]] = []
    offer: dict[str, Any] = {}  # name -> [group, {state: [kind, dtype, shape or value]}]
    for g, tensor, cut in slots:
        for name in _names(tensor, cut):
            offer.setdefault(name, [g, {}])
        for sname, value in optimizer.state.get(tensor, {}).items():
            if _is_per_element(value, tensor):
                for name, piece in cut(to_array(value, f"optimizer state {sname!r}").reshape(-1)).items():
                    pieces.append((name, sname, piece))
                    offer[name][1][sname] = ["array", str(piece.dtype), list(piece.global_shape)]
            elif value is not None:  # a step count: the same on every shard
                for name in _names(tensor, cut):
                    offer[name][1][sname] = scalar_spec(value)
    merged: dict[str, Any] = {}
    for every in _gather_json(fsdp.shard_group, offer):
        for name, (g, states) in every.items():
            merged.setdefault(name, [g, {}])[1].update(states)
    order = {name: i for i, name in enumerate(_module_order(fsdp))}
    names = sorted(merged, key=lambda n: order.get(n, len(order)))
    arrays = {
        (n, s): np.zeros(int(np.prod(spec[2])), np.dtype(spec[1]))
        for n in names
        for s, spec in sorted(merged[n][1].items())
        if spec[0] == "array"
    }
    for name, sname, piece in pieces:
        arrays[name, sname][piece.start : piece.stop] = to_host(piece.local)
    for dtype in sorted({a.dtype.str for a in arrays.values()}):  # one all-reduce per dtype
        keys = [k for k, a in arrays.items() if a.dtype.str == dtype]
        flat = np.concatenate([arrays[k] for k in keys])
        fsdp.shard_group.all_reduce(flat)
        offsets = np.cumsum([0, *(arrays[k].size for k in keys)])
        for k, lo, hi in zip(keys, offsets[:-1], offsets[1:], strict=True):
            arrays[k] = flat[lo:hi]
    state: dict[str, dict[str, Any]] = {}
    for name in names:
        entry = state.setdefault(name, {})
        for sname, (kind, dtype, spec) in sorted(merged[name][1].items()):
            if kind == "array":
                entry[sname] = to_torch(arrays[name, sname].reshape(spec).copy())
            else:
                entry[sname] = scalar_value(kind, dtype, spec)
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": []}
        for group in optimizer.param_groups
    ]
    for name in names:
        groups[merged[name][0]]["params"].append(name)
    return {"state": {n: s for n, s in state.items() if s}, "param_groups": groups}


def optim_state_dict_to_load(fsdp: FSDP, optimizer: Any, full: dict[str, Any]) -> dict[str, Any]:
    """``full`` (as ``full_optim_state_dict`` gives it, from any world size or strategy) as ``optimizer``'s own
    ``state_dict()``: this rank's pieces of every state tensor, to pass to ``optimizer.load_state_dict``. No
    communication."""
    import torch

    if not isinstance(full, dict) or not isinstance(full.get("state"), dict) or "param_groups" not in full:
        raise ValueError("FSDP.optim_state_dict_to_load takes what FSDP.optim_state_dict returned")
    slots = {id(t): cut for _, t, cut in _stepped(fsdp, optimizer, "optim_state_dict_to_load")}
    saved_groups = full["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the optimizer state dict holds {len(saved_groups)} param groups, "
            f"{type(optimizer).__name__} has {len(optimizer.param_groups)}"
        )
    own = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for index, tensor in enumerate(tensors):
        cut = slots.get(id(tensor))
        if cut is None:
            raise ValueError(
                f"FSDP.optim_state_dict_to_load: the optimizer steps a tensor of shape {tuple(tensor.shape)} "
                "that is not one of this FSDP's parameters()"
            )
        names = _names(tensor, cut)
        saved = [full["state"][n] for n in names if n in full["state"]]
        if not saved:
            continue
        if len(saved) != len(names):
            missing = [n for n in names if n not in full["state"]]
            raise ValueError(f"FSDP.optim_state_dict_to_load: no state for {missing} (beside {names})")
        entry: dict[str, Any] = {}
        for sname, value in saved[0].items():
            if not (torch.is_tensor(value) and value.dim() > 0):
                entry[sname] = value.clone() if torch.is_tensor(value) else value
                continue
            flat = torch.zeros(int(tensor.numel()), dtype=tensor.dtype, device=tensor.device)
            for name, piece in cut(to_array(flat, f"optimizer state {sname!r}")).items():
                source = full["state"][name].get(sname)
                if source is None or int(source.numel()) != piece.numel:
                    raise ValueError(
                        f"FSDP.optim_state_dict_to_load: {name!r} state {sname!r} has "
                        f"{'no value' if source is None else f'shape {tuple(source.shape)}'}, expected "
                        f"{piece.global_shape}"
                    )
                host = to_host(to_array(source.detach().cpu().reshape(-1), f"{name}.{sname}"))
                piece.local[...] = array_module(piece.local).asarray(host[piece.start : piece.stop])
            entry[sname] = flat.view(tensor.shape)
        state[index] = entry
    groups = [
        {**{k: v for k, v in saved.items() if k != "params"}, "params": mine["params"]}
        for saved, mine in zip(saved_groups, own["param_groups"], strict=True)
    ]
    return {"state": state, "param_groups": groups}
