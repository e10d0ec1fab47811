"""torch FSDP1's full optimizer state dict under pp.FSDP (transformers' GPT-2, float64, AdamW, world 2).

``pp.FSDP.optim_state_dict(fsdp, opt)`` after ``STEPS`` steps equals one process's AdamW state on the whole
batch, by parameter name (every state tensor to 1e-9, the step count and the hyperparameters), the same on every
rank, and what torch's own FSDP1 (over gloo, same ranks and batches) saves: names, tensors, param groups; ``torch.save`` round-trips it; ``pp.FSDP.optim_state_dict_to_load`` puts it into a fresh wrapper of
another layout (flat full_shard saved, no_shard loaded; use_orig_params with param groups by name saved and
loaded) and one more step there equals one process's ``STEPS + 1`` steps. A plain torch optimizer over the
plain model loads it by name too (the consolidation a plain script does). Mismatches are ValueErrors.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp

STEPS = 2
LR = 1e-2


def _groups(named: list[tuple[str, Any]], by_name: bool) -> list[dict[str, Any]]:
    """One group, or torch users' two: no weight decay on biases and LayerNorms."""
    if not by_name:
        return [{"params": [p for _, p in named], "weight_decay": 0.1}]
    plain = [n.endswith(".bias") or ".ln_" in n for n, _ in named]
    return [
        {"params": [p for (_, p), skip in zip(named, plain) if not skip], "weight_decay": 0.1},
        {"params": [p for (_, p), skip in zip(named, plain) if skip], "weight_decay": 0.0},
    ]


def _train(model: Any, opt: Any, steps: range, rank: int | None, n: int) -> None:
    """Steps of the usual loop; ``rank`` None: one process on every rank's batch."""
    for step in steps:
        parts = [rank] if rank is not None else list(range(n))
        loss = sum(model(**tm.batch("gpt2", step, r)).loss for r in parts) / len(parts)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _close(a: Any, b: Any) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-9, atol=1e-12))


def _check_against(rep: Report, label: str, osd: dict[str, Any], ref: Any, ref_opt: Any) -> None:
    """``osd`` (by name) equals the plain ``ref_opt``'s state over ``ref`` (by parameter)."""
    named = list(ref.named_parameters())
    rep.check(
        f"{label}: one entry per parameter, in the module's order",
        list(osd["state"]) == [n for n, _ in named],
        str(list(osd["state"])[:4]),
    )
    bad = []
    for name, param in named:
        got, want = osd["state"].get(name, {}), ref_opt.state[param]
        if sorted(got) != sorted(want) or not all(_close(got[k], want[k]) for k in want):
            bad.append(name)
    rep.check(f"{label}: every state tensor and step = one process", not bad, f"differ: {bad[:4]}")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
    rep.check(
        f"{label}: hyperparameters = one process",
        hyper == [{k: v for k, v in g.items() if k != "params"} for g in ref_opt.param_groups],
        str(hyper),
    )
    members = [{id(p) for p in g["params"]} for g in ref_opt.param_groups]
    rep.check(
        f"{label}: param groups by name",
        [g["params"] for g in osd["param_groups"]] == [[n for n, p in named if id(p) in m] for m in members],
        str([g["params"][:3] for g in osd["param_groups"]]),
    )


def _torch_fsdp1(world: Any, orig: bool, by_name: bool) -> dict[str, Any]:
    """torch's own FSDP1 (gloo, the same ranks and batches) trained as ours: its ``FSDP.optim_state_dict``."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    tm.init_gloo(world)
    model = FullyShardedDataParallel(tm.build("gpt2"), device_id=torch.device("cpu"), use_orig_params=orig)
    opt = torch.optim.AdamW(_groups(list(model.named_parameters()), by_name), lr=LR)
    _train(model, opt, range(STEPS), world.rank, world.world_size)
    osd: dict[str, Any] = FullyShardedDataParallel.optim_state_dict(model, opt)
    return osd


def _check_same_as_torch(rep: Report, label: str, ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Ours holds what torch's FSDP1 holds: the same names (tied aliases alike), state keys, values (1e-9),
    param groups and hyperparameters (dict order aside: torch's state is not in the module's order)."""
    rep.check(
        f"{label}: the parameter names torch's FSDP1 saves",
        sorted(ours["state"]) == sorted(theirs["state"]),
        f"{sorted(set(ours['state']) ^ set(theirs['state']))[:4]}",
    )
    bad, aliased = [], 0
    for name, want in theirs["state"].items():
        if sorted(ours["state"].get(name, {})) != sorted(want):
            bad.append(name)
            continue
        # torch 2.13's FSDP1 under use_orig_params (CPU, gloo) gives one storage for all of a parameter's state
        # tensors (exp_avg reads as exp_avg_sq): values are compared where its tensors are distinct
        storages = [v.untyped_storage().data_ptr() for v in want.values() if v.dim() > 0]
        if len(set(storages)) < len(storages):
            aliased += 1
        elif not all(_close(ours["state"][name][k], want[k]) for k in want):
            bad.append(name)
    rep.check(f"{label}: every state tensor = torch FSDP1's", not bad, f"differ: {bad[:4]}")
    if label == "flat":
        rep.check(f"{label}: torch's values were all compared", aliased == 0, f"{aliased} aliased")
    rep.check(
        f"{label}: param groups = torch FSDP1's",
        ours["param_groups"] == theirs["param_groups"],
        f"{[g['params'][:3] for g in ours['param_groups']]} vs {[g['params'][:3] for g in theirs['param_groups']]}",
    )


def scenario(world: Any, rep: Report) -> None:
    import torch

    g, n = world.group, world.world_size
    for label, saved_as, loaded_as, by_name in (
        ("flat", "full_shard", "no_shard", False),
        ("use_orig_params", "full_shard", "full_shard", True),
    ):
        orig = by_name
        ref = tm.build("gpt2")
        ref_opt = torch.optim.AdamW(_groups(list(ref.named_parameters()), by_name), lr=LR)
        _train(ref, ref_opt, range(STEPS), None, n)
        fsdp = pp.FSDP(tm.build("gpt2"), g, saved_as, use_orig_params=orig)
        opt = torch.optim.AdamW(_groups(list(fsdp.named_parameters()), by_name), lr=LR)
        _train(fsdp, opt, range(STEPS), world.rank, n)
        osd = pp.FSDP.optim_state_dict(fsdp, opt)
        _check_against(rep, label, osd, ref, ref_opt)
        _check_same_as_torch(rep, label, osd, _torch_fsdp1(world, orig, by_name))
        buffer = io.BytesIO()
        torch.save(osd, buffer)
        flat = np.concatenate([v.reshape(-1).numpy() for s in osd["state"].values() for v in s.values()])
        every = g.all_gather(flat).reshape(n, -1)
        rep.check(f"{label}: the same on every rank", all(_close(every[0], r) for r in every), "")

        # a plain script's consolidation: a torch optimizer over the plain model, by name
        plain = tm.build("gpt2")
        plain.load_state_dict(fsdp.state_dict())
        plain_opt = torch.optim.AdamW(_groups(list(plain.named_parameters()), by_name), lr=LR)
        index = {name: i for i, (name, _) in enumerate(plain.named_parameters())}
        plain_opt.load_state_dict(
            {
                "state": {index[k]: v for k, v in osd["state"].items()},
                "param_groups": [
                    {**group, "params": [index[k] for k in group["params"]]} for group in osd["param_groups"]
                ],
            }
        )
        _check_against(rep, f"{label} loaded into a plain optimizer", osd, plain, plain_opt)

        # resume in a fresh wrapper of another layout, from the torch.save'd bytes
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        fresh = pp.FSDP(tm.build("gpt2", seed=1), g, loaded_as, use_orig_params=orig)
        fresh.load_state_dict(fsdp.state_dict())
        fresh_opt = torch.optim.AdamW(_groups(list(fresh.named_parameters()), by_name), lr=0.5)
        pp.FSDP.optim_state_dict_to_load(fresh, fresh_opt, loaded, load_directly=True)
        rep.check(f"{label}: the saved learning rate is back", fresh_opt.param_groups[0]["lr"] == LR, "")
        _train(fresh, fresh_opt, range(STEPS, STEPS + 1), world.rank, n)
        _train(ref, ref_opt, range(STEPS, STEPS + 1), None, n)
        got, want = fresh.state_dict(), ref.state_dict()
        bad = [k for k in want if not _close(got[k].numpy(), want[k].detach().numpy())]
        rep.check(f"{label}: one more step after loading = one process", not bad, f"differ: {bad[:4]}")

    rep.raises(
        "a state dict with another number of param groups",
        ValueError,
        lambda: pp.FSDP.optim_state_dict_to_load(fresh, torch.optim.AdamW(fresh.parameters(), lr=LR), osd),
        "2 param groups",
        "has 1",
    )
    rep.raises(
        "an optimizer over other tensors",
        ValueError,
        lambda: pp.FSDP.optim_state_dict(fresh, torch.optim.AdamW(plain.parameters(), lr=LR)),
        "steps none of this FSDP's parameters",
    )
    rep.raises(
        "not a torch optimizer",
        ValueError,
        lambda: pp.FSDP.optim_state_dict(fresh, object()),
        "torch.optim optimizer",
    )


def older_api(world: Any, rep: Report) -> None:
    """torch FSDP1's older optimizer-state API and its state-dict settings, as scripts from before
    ``optim_state_dict`` call them: ``full_optim_state_dict`` (rank 0 only by default) equals torch FSDP1's
    (gloo) and one process's; ``rekey_optim_state_dict`` to ids and back equals torch's; the name-keyed dict
    loads through ``shard_full_optim_state_dict`` (without the optimizer: torch's one-group assumption) and
    ``scatter_full_optim_state_dict`` (only rank 0 holds it) into fresh wrappers of other strategies, where one
    more step equals one process."""
    import torch
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, OptimStateKeyType
    from torch.distributed.fsdp import StateDictType as SDT

    g, n, rank = world.group, world.world_size, world.rank
    ref = tm.build("gpt2")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    _train(ref, ref_opt, range(STEPS), None, n)
    fsdp = pp.FSDP(tm.build("gpt2"), g, "full_shard")
    opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
    _train(fsdp, opt, range(STEPS), rank, n)
    tm.init_gloo(world)
    theirs_model = FullyShardedDataParallel(tm.build("gpt2"), device_id=torch.device("cpu"))
    theirs_opt = torch.optim.AdamW(theirs_model.parameters(), lr=LR)
    _train(theirs_model, theirs_opt, range(STEPS), rank, n)
    theirs = FullyShardedDataParallel.full_optim_state_dict(theirs_model, theirs_opt)
    ours = pp.FSDP.full_optim_state_dict(fsdp, opt)
    if rank == 0:
        _check_same_as_torch(rep, "full_optim_state_dict", ours, theirs)
        _check_against(rep, "full_optim_state_dict", ours, ref, ref_opt)
    else:
        rep.check(
            "rank0_only: the other ranks get {}, as torch's", ours == {} and theirs == {}, str(list(ours))
        )
    full = pp.FSDP.full_optim_state_dict(fsdp, opt, rank0_only=False)
    _check_against(rep, "full_optim_state_dict(rank0_only=False)", full, ref, ref_opt)

    plain = tm.build("gpt2")
    by_id = pp.FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, plain)
    want = FullyShardedDataParallel.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, plain)
    rep.check(
        "rekey to ids = torch's",
        list(by_id["state"]) == list(want["state"]) and by_id["param_groups"] == want["param_groups"],
        f"{list(by_id['state'])[:4]} vs {list(want['state'])[:4]}",
    )
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    plain_opt.load_state_dict(by_id)
    by_name = pp.FSDP.rekey_optim_state_dict(plain_opt.state_dict(), OptimStateKeyType.PARAM_NAME, plain)
    rep.check("rekey back to names = what was saved", list(by_name["state"]) == list(full["state"]), "")
    rep.check("... and their param groups", by_name["param_groups"] == full["param_groups"], "")

    _train(ref, ref_opt, range(STEPS, STEPS + 1), None, n)
    expected = ref.state_dict()
    for how, strategy in (("shard_full_optim_state_dict", "shard_grad_op"), ("scatter", "no_shard")):
        fresh = pp.FSDP(tm.build("gpt2", seed=1), g, strategy)
        fresh.load_state_dict(fsdp.state_dict())
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        if how == "scatter":
            mine = pp.FSDP.scatter_full_optim_state_dict(
                by_name if rank == 0 else None, fresh, optim=fresh_opt
            )
        else:
            mine = pp.FSDP.shard_full_optim_state_dict(by_name, fresh)
        fresh_opt.load_state_dict(mine)
        rep.check(f"{how}: the saved learning rate is back", fresh_opt.param_groups[0]["lr"] == LR, "")
        _train(fresh, fresh_opt, range(STEPS, STEPS + 1), rank, n)
        got = fresh.state_dict()
        bad = [k for k in expected if not _close(got[k].numpy(), expected[k].detach().numpy())]
        rep.check(f"{how}: one more step after loading = one process", not bad, f"differ: {bad[:4]}")
    rep.raises(
        "scatter with nothing on rank 0 fails on every rank",
        ValueError,
        lambda: pp.FSDP.scatter_full_optim_state_dict(None, fsdp),
        "rank 0 passes what full_optim_state_dict gave",
    )

    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    before = pp.FSDP.set_state_dict_type(fsdp, SDT.FULL_STATE_DICT, config)
    rep.check(
        "set_state_dict_type returns the settings before", before.state_dict_type == SDT.FULL_STATE_DICT, ""
    )
    rep.check(
        "get_state_dict_type gives the config set",
        pp.FSDP.get_state_dict_type(fsdp).state_dict_config is config,
    )
    inner = FullStateDictConfig(offload_to_cpu=False)
    with pp.FSDP.state_dict_type(fsdp, SDT.FULL_STATE_DICT, inner):
        rep.check(
            "inside state_dict_type: its config", pp.FSDP.get_state_dict_type(fsdp).state_dict_config is inner
        )
    rep.check(
        "after state_dict_type: the config before",
        pp.FSDP.get_state_dict_type(fsdp).state_dict_config is config,
    )
    rep.raises(
        "set_state_dict_type(SHARDED_STATE_DICT)",
        ValueError,
        lambda: pp.FSDP.set_state_dict_type(fsdp, SDT.SHARDED_STATE_DICT),
        "sharded_state_dict()",
    )
    rep.check("fsdp_modules", pp.FSDP.fsdp_modules(fsdp) == [fsdp] and pp.FSDP.fsdp_modules(plain) == [], "")


if __name__ == "__main__":
    run_rank({"current": scenario, "older": older_api}[sys.argv[1] if len(sys.argv) > 1 else "current"])
