"""paramplane: an asyncio + gRPC parameter plane for distributed training.

``pp.init()`` joins the world; ``world.group`` and ``world.new_group`` give
collectives; ``pp.nn`` / ``pp.optim`` hold the reference modules and optimizers.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from paramplane.node.errors import (
    AuthError,
    CollectiveMismatch,
    CollectiveTimeout,
    CoordinatorUnavailable,
    DeviceCommError,
    PeerLost,
    PlaneClosed,
    PlaneError,
    RendezvousError,
    TransportError,
    WorldAborted,
)

# gRPC's fork handlers crash a child forked while gRPC's threads run (torch's DataLoader workers forked by a rank
# segfaulted: grpc/grpc#32992). No forked child of a rank uses gRPC, so they are off unless the user set them
# (before gRPC is first imported: paramplane's own modules import it on first use, below).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

if TYPE_CHECKING:
    from paramplane import checkpoint, nn, optim
    from paramplane.group import ProcessGroup
    from paramplane.parallel.ddp import DDP, shard_range
    from paramplane.parallel.diloco import DiLoCo
    from paramplane.parallel.fsdp import FSDP, CPUOffload, MixedPrecision, units_by_class
    from paramplane.parallel.grad_scaler import ShardedGradScaler
    from paramplane.parallel.mesh import Mesh
    from paramplane.parallel.pipeline import Pipeline, causal_lm_loss, pipeline_optim_state, pipeline_split
    from paramplane.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
    from paramplane.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    from paramplane.parallel.tensor_attention import TensorParallelAttention
    from paramplane.parallel.tp_torch import (
        ColwiseParallel,
        ExpertParallel,
        RowwiseParallel,
        SequenceParallel,
        VocabParallel,
        parallelize,
        tp_full_state_dict,
        tp_optim_state,
        tp_plan_for,
        vocab_parallel_cross_entropy,
    )
    from paramplane.torch_distributed import init_torch_distributed
    from paramplane.work import Work
    from paramplane.world import KVStore, World, init

# Heavy parts (grpc, numpy, the runtime) load on first use, so the CLI starts fast.
_LAZY = {
    "DDP": "paramplane.parallel.ddp",
    "DiLoCo": "paramplane.parallel.diloco",
    "shard_range": "paramplane.parallel.ddp",
    "Mesh": "paramplane.parallel.mesh",
    "FSDP": "paramplane.parallel.fsdp",
    "units_by_class": "paramplane.parallel.fsdp",
    "ColumnParallelLinear": "paramplane.parallel.tensor",
    "Pipeline": "paramplane.parallel.pipeline",
    "pipeline_split": "paramplane.parallel.pipeline",
    "pipeline_optim_state": "paramplane.parallel.pipeline",
    "causal_lm_loss": "paramplane.parallel.pipeline",
    "RowParallelLinear": "paramplane.parallel.tensor",
    "TensorParallelAttention": "paramplane.parallel.tensor_attention",
    "MixedPrecision": "paramplane.parallel.fsdp",
    "ColwiseParallel": "paramplane.parallel.tp_torch",
    "ExpertParallel": "paramplane.parallel.tp_torch",
    "RowwiseParallel": "paramplane.parallel.tp_torch",
    "SequenceParallel": "paramplane.parallel.tp_torch",
    "VocabParallel": "paramplane.parallel.tp_torch",
    "parallelize": "paramplane.parallel.tp_torch",
    "tp_full_state_dict": "paramplane.parallel.tp_torch",
    "tp_optim_state": "paramplane.parallel.tp_torch",
    "tp_plan_for": "paramplane.parallel.tp_torch",
    "vocab_parallel_cross_entropy": "paramplane.parallel.tp_torch",
    "CPUOffload": "paramplane.parallel.fsdp",
    "SyncBatchNorm": "paramplane.parallel.sync_batchnorm",
    "ShardedGradScaler": "paramplane.parallel.grad_scaler",
    "convert_sync_batchnorm": "paramplane.parallel.sync_batchnorm",
    "nn": "paramplane.nn",
    "checkpoint": "paramplane.checkpoint",
    "optim": "paramplane.optim",
    "ProcessGroup": "paramplane.group",
    "Work": "paramplane.work",
    "KVStore": "paramplane.world",
    "World": "paramplane.world",
    "init": "paramplane.world",
    "init_torch_distributed": "paramplane.torch_distributed",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'paramplane' has no attribute {name!r}")
    value = (
        importlib.import_module(module)
        if module.endswith(f".{name}")
        else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "DDP",
    "FSDP",
    "AuthError",
    "CPUOffload",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "ColumnParallelLinear",
    "ColwiseParallel",
    "CoordinatorUnavailable",
    "DeviceCommError",
    "DiLoCo",
    "ExpertParallel",
    "KVStore",
    "Mesh",
    "MixedPrecision",
    "PeerLost",
    "Pipeline",
    "PlaneClosed",
    "PlaneError",
    "ProcessGroup",
    "RendezvousError",
    "RowParallelLinear",
    "RowwiseParallel",
    "SequenceParallel",
    "ShardedGradScaler",
    "SyncBatchNorm",
    "TensorParallelAttention",
    "TransportError",
    "VocabParallel",
    "Work",
    "World",
    "WorldAborted",
    "causal_lm_loss",
    "checkpoint",
    "convert_sync_batchnorm",
    "init",
    "init_torch_distributed",
    "nn",
    "optim",
    "parallelize",
    "pipeline_optim_state",
    "pipeline_split",
    "shard_range",
    "tp_full_state_dict",
    "tp_optim_state",
    "tp_plan_for",
    "units_by_class",
    "vocab_parallel_cross_entropy",
]
