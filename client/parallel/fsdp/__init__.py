"""``pp.FSDP``: fully sharded data parallelism (ZeRO), one folder of composed parts.

- ``wrapper.py``: ``FSDP`` (and ``TorchFSDP``, what ``FSDP(torch_module, ...)`` makes), composing the rest;
- ``config.py``: the options (``STRATEGIES`` and ``ShardingStrategy``, ``MixedPrecision``, ``CPUOffload``)
  and the measured memory accounting;
- ``units.py``: the flat units, building them, ``units_by_class`` and ``check_same_model``;
- ``gather.py``: the all-gathers and prefetch order; ``reduce.py``: the gradient reductions;
- ``state.py``: full and sharded state dicts and ``summon_full_params``; ``optim_state.py``: a torch
  optimizer's state over the shards, as checkpoint entries that reshard (``fsdp.optim_state(opt)``);
  ``optim_full.py``: torch FSDP1's full optimizer state dict (``FSDP.optim_state_dict``);
  ``optim_guard.py``: the refusal of an optimizer over the module's own parameters;
- ``frozen.py``: when a unit holding frozen parameters (``use_orig_params``) reshards in the backward;
- ``fsdp1_args.py``: torch FSDP1's constructor keywords (``sharding_strategy``, ``auto_wrap_policy``, ...);
- ``nn_path.py`` / ``torch_adapter.py``: the module paths, for a ``paramplane.nn`` and a ``torch.nn`` module.
"""

from __future__ import annotations

from paramplane.parallel.fsdp.config import (
    STRATEGIES,
    CPUOffload,
    MemoryTracker,
    MixedPrecision,
    ShardingStrategy,
)
from paramplane.parallel.fsdp.units import FlatUnit, UnitsByClass, check_same_model, units_by_class
from paramplane.parallel.fsdp.wrapper import FSDP, TorchFSDP

__all__ = [
    "FSDP",
    "STRATEGIES",
    "CPUOffload",
    "FlatUnit",
    "MemoryTracker",
    "MixedPrecision",
    "ShardingStrategy",
    "TorchFSDP",
    "UnitsByClass",
    "check_same_model",
    "units_by_class",
]
