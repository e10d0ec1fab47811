"""``pp.parallelize(module, tp_group, plan)``: tensor parallel for torch modules, shaped like torch's
``parallelize_module``.

``plan`` maps module names to styles. A name is a glob over the module's dotted name as
``module.named_modules()`` gives it (``fnmatch``: ``*`` also crosses dots, so ``"*attn.c_attn"`` matches the
projection in every block, whether ``module`` is the whole model or a pipeline stage holding some blocks). A
style is ``"colwise"``, ``"rowwise"``, ``"vocab"``, ``"sequence"`` or a ``ColwiseParallel`` /
``RowwiseParallel`` / ``VocabParallel`` / ``SequenceParallel`` with options (see ``styles.py``). Everything is checked before anything changes: an unmatched pattern, a
module two patterns match, a style that does not fit a module, sizes (heads, vocabulary, features) that do
not divide by tp, a tied parameter only one of whose modules is split: each a ValueError.

The module is changed in place and returned: its parameters are this rank's pieces (each with a ``tp_shard``),
its keys are unchanged. ``pp.tp_full_state_dict(module)`` gives the dense state; the returned module also has
``full_state_dict()`` and the ``sharded_state_dict`` / ``load_sharded_state_dict`` pair that ``pp.checkpoint``
uses, so ``pp.checkpoint.save({"model": module}, ...)`` writes the dense model, loadable at any tp size, and
``optim_state(opt)`` (``pp.tp_optim_state``) for a torch optimizer's state, which reshards the same way.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Mapping
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.torch_params import is_torch_module
from paramplane.parallel.tp_torch import families, styles
from paramplane.parallel.tp_torch.comm import SharedCopy
from paramplane.parallel.tp_torch.optim import tp_optim_state
from paramplane.parallel.tp_torch.state import (
    tp_full_state_dict,
    tp_load_sharded_state_dict,
    tp_sharded_state_dict,
)

__all__ = ["parallelize"]


def _match(module: Any, plan: Mapping[str, Any]) -> dict[str, styles.Style]:
    """Module name -> style for every module the plan names."""
    names = [n for n, _ in module.named_modules() if n]
    chosen: dict[str, styles.Style] = {}
    by: dict[str, str] = {}
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise ValueError(f"plan keys are module-name globs (str), got {pattern!r}")
        style = styles.resolve_style(value, pattern)
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"plan entry {pattern!r} matches no module of {type(module).__name__} "
                f"(names look like {names[:4]}...)"
            )
        for n in hits:
            if n in chosen:
                raise ValueError(f"module {n!r} is matched by both {by[n]!r} and {pattern!r}")
            chosen[n], by[n] = style, pattern
    return chosen


def _check_ties(module: Any, chosen: dict[str, styles.Style]) -> None:
    """A parameter shared by several modules (tied embedding and head) is split in all of them or in none."""
    owners: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for pname, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    splitting = {n for n, s in chosen.items() if not isinstance(s, styles.SequenceParallel)}
    for users in owners.values():
        split = [u for u in users if u.rsplit(".", 1)[0] in splitting]
        if split and len(split) < len(users):
            raise ValueError(
                f"parameter {users[0]!r} is tied to {users[1:]}; the plan splits only {split}: "
                "split every module that shares it (e.g. the embedding 'vocab' and the head 'colwise') or none"
            )


def parallelize(module: Any, tp_group: ProcessGroup, plan: Mapping[str, Any]) -> Any:
    """Split ``module``'s layers over ``tp_group`` as ``plan`` says (see the module docstring); returns
    ``module``. Every rank of ``tp_group`` calls it on the same (dense, equally initialised) model."""
    if not is_torch_module(module):
        raise ValueError(
            f"pp.parallelize takes a torch.nn.Module, got {type(module).__name__}; for paramplane.nn models "
            "use pp.ColumnParallelLinear / pp.RowParallelLinear / pp.TensorParallelAttention"
        )
    if not isinstance(tp_group, ProcessGroup):
        raise ValueError(
            f"pp.parallelize needs a ProcessGroup (mesh.group('tp')), got {type(tp_group).__name__}"
        )
    if not isinstance(plan, Mapping):
        raise ValueError(f"plan must be a mapping of module-name globs to styles, got {type(plan).__name__}")
    tp = tp_group.size
    chosen = _match(module, plan)
    subs = dict(module.named_modules())
    families.check_attention(module, chosen, tp)
    for name, style in chosen.items():
        styles.check(name, subs[name], style, tp)
    _check_ties(module, chosen)
    copy = SharedCopy(tp_group)
    done: dict[int, Any] = {}
    for name, style in chosen.items():
        styles.apply(subs[name], style, tp_group, copy, done)
    families.adjust_attention(module, chosen, tp_group)
    module.full_state_dict = types.MethodType(tp_full_state_dict, module)
    module.sharded_state_dict = types.MethodType(tp_sharded_state_dict, module)
    module.load_sharded_state_dict = types.MethodType(tp_load_sharded_state_dict, module)
    module.optim_state = types.MethodType(tp_optim_state, module)
    return module
