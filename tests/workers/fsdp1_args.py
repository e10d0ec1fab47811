"""torch FSDP1's constructor arguments on pp.FSDP (transformers' GPT-2, float64, world 2).

The units each of torch's auto-wrap policies picks are the modules torch's own FSDP1 wraps under that policy
(FSDP1 over gloo on the same ranks); a script's FSDP1 call (``sharding_strategy``, ``auto_wrap_policy``,
``backward_prefetch``, ``cpu_offload``, ``device_id``, ``limit_all_gathers``) trains equal to one process on the
whole batch; what pp.FSDP cannot honour is a ValueError naming it.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp

STEPS = 2


def _torch_fsdp1_units(world: Any, policy: Any) -> list[str]:
    """The module paths torch's FSDP1 wraps under ``policy`` (the root left out)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    tm.init_gloo(world)
    model = tm.build("gpt2")
    paths = {id(m): p for p, m in model.named_modules()}
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    return sorted(
        paths[id(f.module)] for f in FullyShardedDataParallel.fsdp_modules(wrapped) if f is not wrapped
    )


def scenario(world: Any, rep: Report) -> None:
    import torch
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
    from torch.distributed.fsdp.wrap import (
        ModuleWrapPolicy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    g, n = world.group, world.world_size
    policies = {
        "transformer_auto_wrap_policy": functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block}
        ),
        "ModuleWrapPolicy": ModuleWrapPolicy({GPT2Block}),
        # a block has 3,280 parameters: its MLP is wrapped, then the transformer for what remains
        "size_based_auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=2000),
    }
    for name, policy in policies.items():
        fsdp = pp.FSDP(tm.build("gpt2"), g, auto_wrap_policy=policy)
        ours = sorted(u.name for u in fsdp.units if u.module is not None)
        want = _torch_fsdp1_units(world, policy)
        rep.check(f"{name}: the units torch FSDP1 wraps", ours == want, f"{ours} vs {want}")

    model = tm.build("gpt2")
    fsdp = pp.FSDP(
        model,
        process_group=g,  # FSDP1's keyword for the group
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        auto_wrap_policy=policies["transformer_auto_wrap_policy"],
        backward_prefetch=BackwardPrefetch.BACKWARD_POST,
        cpu_offload=CPUOffload(offload_params=False),
        device_id=torch.device("cpu"),
        limit_all_gathers=True,
        sync_module_states=True,
        use_orig_params=True,
    )
    rep.check("process_group", fsdp.group is g, repr(fsdp.group))
    rep.check("sharding_strategy", fsdp.strategy == "shard_grad_op", fsdp.strategy)
    rep.check("backward_prefetch", fsdp.backward_prefetch == "post", str(fsdp.backward_prefetch))
    rep.check("CPUOffload(offload_params=False) is off", not fsdp.offload.params, str(fsdp.offload))
    ref = tm.build("gpt2")
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        loss = tm.loss64(fsdp, tm.batch("gpt2", step, world.rank))
        loss.backward()
        fsdp.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = np.array([float(loss)])
        g.all_reduce(total)
        ref_loss = tm.loss64(ref, tm.global_batch("gpt2", step, n))
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        rep.check(
            f"step {step}: loss = one process",
            bool(np.isclose(total[0] / n, float(ref_loss), rtol=1e-9)),
            f"{total[0] / n} vs {float(ref_loss)}",
        )
    got, want = fsdp.state_dict(), ref.state_dict()
    bad = [k for k in want if not np.allclose(got[k].numpy(), want[k].numpy(), rtol=1e-9, atol=1e-12)]
    rep.check("parameters = one process", not bad, str(bad[:4]))

    rep.raises(
        "ignored_modules",
        ValueError,
        lambda: pp.FSDP(tm.build("gpt2"), g, ignored_modules=[model.lm_head]),
        "ignored_modules not supported",
    )
    rep.raises(
        "units and auto_wrap_policy together",
        ValueError,
        lambda: pp.FSDP(
            tm.build("gpt2"),
            g,
            units=pp.units_by_class(GPT2Block),
            auto_wrap_policy=policies["ModuleWrapPolicy"],
        ),
        "not both",
    )
    rep.raises(
        "strategy and sharding_strategy disagreeing",
        ValueError,
        lambda: pp.FSDP(tm.build("gpt2"), g, "no_shard", sharding_strategy=ShardingStrategy.FULL_SHARD),
        "disagree",
    )


if __name__ == "__main__":
    run_rank(scenario)
