"""torch FSDP1's constructor arguments, for scripts written against ``FullyShardedDataParallel(model, ...)``.

``pp.FSDP(model, world.group, sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=policy,
backward_prefetch=BackwardPrefetch.BACKWARD_PRE, device_id=local_rank, limit_all_gathers=True, ...)`` takes
FSDP1's keywords and turns them into pp.FSDP's own: the strategy's name, the unit modules the policy picks
(torch's own policy objects and callables, run the way FSDP1 runs them), the prefetch mode, the module moved to
``device_id``. Arguments FSDP1 has and pp.FSDP cannot honour are ValueErrors naming them.
"""

from __future__ import annotations

from typing import Any, cast

from paramplane.parallel.fsdp.config import STRATEGIES, CPUOffload

__all__ = ["cpu_offload_of", "translate"]


def translate(
    module: Any,
    strategy: str,
    units: Any,
    backward_prefetch: Any,
    *,
    sharding_strategy: Any,
    auto_wrap_policy: Any,
    device_id: Any,
    torch_module: bool,
    unsupported: dict[str, Any],
) -> tuple[str, Any, str | None]:
    """pp.FSDP's (strategy, units, backward_prefetch) from its own arguments and FSDP1's; moves the module to
    ``device_id``. ``unsupported``: FSDP1's arguments pp.FSDP does not take (ValueError unless None)."""
    named = sorted(k for k, v in unsupported.items() if v is not None)
    if named:
        raise ValueError(
            f"FSDP: {', '.join(named)} not supported (torch FSDP1 arguments pp.FSDP does not have: wrap a "
            "module without what should be ignored, initialise it before wrapping)"
        )
    if (auto_wrap_policy is not None or device_id is not None) and not torch_module:
        raise ValueError("auto_wrap_policy and device_id apply to torch modules")
    if auto_wrap_policy is not None:
        if units is not None:
            raise ValueError("FSDP: pass units= or auto_wrap_policy=, not both")
        units = _units_of_policy(module, auto_wrap_policy)
    if device_id is not None:
        _move_to_device(module, device_id)
    return _strategy_of(strategy, sharding_strategy), units, _backward_prefetch_of(backward_prefetch)


def _strategy_of(strategy: str, sharding_strategy: Any) -> str:
    """The strategy name from FSDP1's ``sharding_strategy`` (torch's enum, or its name), or ``strategy``."""
    if sharding_strategy is None:
        return strategy
    name = getattr(sharding_strategy, "name", sharding_strategy)
    chosen = str(name).lower().lstrip("_")
    if chosen not in STRATEGIES:
        raise ValueError(
            f"unknown sharding_strategy {sharding_strategy!r}; torch's ShardingStrategy or one of {STRATEGIES}"
        )
    if strategy not in ("full_shard", chosen):
        raise ValueError(f"FSDP: strategy={strategy!r} and sharding_strategy={chosen!r} disagree: pass one")
    return chosen


def _backward_prefetch_of(value: Any) -> str | None:
    """``"pre"``/``"post"``/None from torch's ``BackwardPrefetch`` (or pp.FSDP's own strings)."""
    name = getattr(value, "name", None)
    if name == "BACKWARD_PRE":
        return "pre"
    if name == "BACKWARD_POST":
        return "post"
    if value not in ("pre", "post", None):
        raise ValueError(
            f"backward_prefetch must be 'pre', 'post', None or torch's BackwardPrefetch, got {value!r}"
        )
    return cast(str | None, value)


def cpu_offload_of(value: Any) -> CPUOffload:
    """pp.FSDP's ``CPUOffload`` from a bool, its own, or torch's ``CPUOffload(offload_params=...)``."""
    if isinstance(value, CPUOffload):
        return value
    if hasattr(value, "offload_params"):
        return CPUOffload(bool(value.offload_params))
    if not isinstance(value, bool):
        raise ValueError(f"cpu_offload must be a bool or a CPUOffload, got {value!r}")
    return CPUOffload(value)


def _move_to_device(module: Any, device_id: Any) -> None:
    """FSDP1's ``device_id``: a module on another device (the CPU) moves there before it is sharded."""
    import torch

    device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if any(p.device != device for p in module.parameters()):
        module.to(device)


def _units_of_policy(module: Any, policy: Any) -> list[Any]:
    """The modules FSDP1 would wrap under ``auto_wrap_policy`` (the root left out: it is pp.FSDP's root unit).

    torch's policy objects (``ModuleWrapPolicy``, ``CustomPolicy``) say so themselves; a callable
    ``(module, recurse, nonwrapped_numel) -> bool`` (``transformer_auto_wrap_policy`` and
    ``size_based_auto_wrap_policy`` through ``functools.partial``, ``lambda_auto_wrap_policy``) is run as FSDP1's
    recursive wrap runs it: children first, each wrapped module's parameters no longer counted by its parents."""
    run = getattr(policy, "_run_policy", None)
    if run is not None:
        return [m for m in run(module, set(), {}) if m is not module]
    if not callable(policy):
        raise ValueError(f"auto_wrap_policy must be torch's policy object or a callable, got {policy!r}")
    chosen: list[Any] = []

    def visit(m: Any, only_children: bool) -> int:
        numel = sum(p.numel() for p in m.parameters())
        if not policy(module=m, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(child, False) for child in m.children())
        if not only_children and policy(module=m, recurse=False, nonwrapped_numel=numel - wrapped):
            chosen.append(m)
            return numel
        return wrapped

    visit(module, True)
    return chosen
