"""pp.FSDP over a torch.nn.Module (CPU): every strategy trains with a torch optimizer on this rank's shards,
and after every step the full parameters equal one process training on the whole batch; gradient
accumulation under no_sync, the global gradient norm, collective counts, resharding between uses,
sharded optimizer state, state dicts, a checkpoint round trip, mixed precision and the errors."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, digest, run_rank
from fsdp import Counting

import paramplane as pp

STEPS = 3
BATCH = 4  # per rank


def _model(seed: int, dtype: Any = None) -> Any:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7),
        torch.nn.Tanh(),
        torch.nn.Linear(7, 13),  # 7 * 13 + 13: no shard size divides it evenly
        torch.nn.Tanh(),
        torch.nn.Linear(13, 3),
    )
    return model.to(dtype or torch.float64)


def _batch(step: int, rank: int, dtype: Any = None) -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(step * 100 + rank)
    x = torch.from_numpy(rng.standard_normal((BATCH, 5)))
    y = torch.from_numpy(rng.standard_normal((BATCH, 3)))
    return x.to(dtype or torch.float64), y.to(dtype or torch.float64)


def _reference_step(ref: Any, opt: Any, step: int, n: int, clip: float | None) -> tuple[float, float | None]:
    import torch

    opt.zero_grad()
    total = sum(torch.nn.functional.mse_loss(ref(_batch(step, r)[0]), _batch(step, r)[1]) for r in range(n))
    loss = total / n
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)) if clip is not None else None
    opt.step()
    return float(loss.detach()), norm


def train(world: Any, rep: Report, counter: Counting, strategy: str) -> None:
    import torch

    g, n, me = world.group, world.world_size, world.rank
    model = _model(seed=me)  # different on every rank: the wrap-time broadcast makes every rank use rank 0's
    fsdp = pp.FSDP(model, g, strategy)
    rep.check(f"{strategy}: the torch FSDP", type(fsdp).__name__ == "TorchFSDP", type(fsdp).__name__)
    num_units = sum(1 for u in fsdp.units if u.module is not None)
    rep.check(f"{strategy}: one unit per Linear", num_units == 3, str(num_units))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=0.05, weight_decay=0.01)
    fsdp.attach(opt)
    ref = _model(seed=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.01)
    for step in range(STEPS):
        accum = 2 if step == 1 else 1
        clip = 0.05 if step == 2 else None
        x, y = _batch(step, me)
        counter.counts.clear()
        counter.on = True
        for i, idx in enumerate(np.array_split(np.arange(BATCH), accum)):
            last = i == accum - 1
            with fsdp.no_sync() if not last else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(fsdp(x[idx]), y[idx]) * (len(idx) / BATCH)
                loss.backward()
            if not last:
                grad_ops = counter.counts["reduce_scatter"] + counter.counts["all_reduce"]
                rep.check(
                    f"{strategy}: no gradient collective inside no_sync", grad_ops == 0, str(counter.counts)
                )
        launched = counter.counts["reduce_scatter"] + counter.counts["all_reduce"]
        rep.check(
            f"{strategy}: step {step}: every unit's reduction started inside loss.backward()",
            launched == num_units,
            str(counter.counts),
        )
        fsdp.finish_gradient_sync()
        counter.on = False
        if step == 0:
            s, r = fsdp.shard_group.size, fsdp.replicate_group.size
            gathers = 0 if s == 1 else (2 * num_units if fsdp.reshard_after_forward else num_units)
            want = {"all_gather": gathers, "reduce_scatter": num_units if s > 1 else 0}
            want["all_reduce"] = num_units if r > 1 else 0
            got = {op: counter.counts[op] for op in want}
            rep.check(f"{strategy}: collectives per step", got == want, f"got {got}, want {want}")
        norm = fsdp.clip_grad_norm_(clip) if clip is not None else None
        opt.step()
        opt.zero_grad()
        _, want_norm = _reference_step(ref, ref_opt, step, n, clip)
        if norm is not None and want_norm is not None:
            rep.check(
                f"{strategy}: global gradient norm",
                abs(norm - want_norm) <= 1e-9 * want_norm,
                f"{norm} vs {want_norm}",
            )
        got_state = fsdp.state_dict()
        for name, value in ref.state_dict().items():
            rep.equal(f"{strategy}: step {step} {name}", got_state[name].numpy(), value.numpy(), rtol=1e-10)
    if fsdp.reshard_after_forward and fsdp.shard_group.size > 1:
        rep.check(
            f"{strategy}: resharded between uses",
            all(all(s == 0 for s in p.stride()) and bool(p.isnan().all()) for p in model.parameters()),
            "a parameter still holds its full values",
        )
    shard_bytes = sum(p.numel() * p.element_size() for p in fsdp.parameters())
    optim = fsdp.memory_stats()["optim_state"]["current"]
    rep.check(
        f"{strategy}: AdamW state is this rank's shards",
        optim == 2 * shard_bytes,
        f"{optim} vs {shard_bytes}",
    )
    full = fsdp.state_dict()
    rep.check(f"{strategy}: state keys", list(full) == list(ref.state_dict()), str(list(full)))
    fsdp.load_state_dict({k: v * 0 for k, v in full.items()})  # torch tensors in
    fsdp.load_state_dict({k: v.numpy() for k, v in full.items()})  # numpy in
    again = fsdp.state_dict()
    rep.check(f"{strategy}: round trip", all(torch.equal(again[k], full[k]) for k in full), "values changed")
    for name, value in full.items():
        rep.digests[f"{strategy}/{name}"] = digest(value.numpy())
    _checkpoint(world, rep, fsdp, opt, strategy)


def _checkpoint(world: Any, rep: Report, fsdp: Any, opt: Any, strategy: str) -> None:
    """The shards (torch Parameters) save and load through pp.checkpoint in place."""
    import torch

    root = Path(tempfile.gettempdir()) / f"pp-torch-fsdp-{world.job_id}-{strategy}"
    before = [p.detach().clone() for p in fsdp.parameters()]
    saved = pp.checkpoint.save({"model": fsdp}, root, world.group)
    with torch.no_grad():
        for p in fsdp.parameters():
            p.zero_()
    pp.checkpoint.load({"model": fsdp}, saved, world.group)
    rep.check(
        f"{strategy}: checkpoint round trip into the torch shards",
        all(torch.equal(p, q) for p, q in zip(fsdp.parameters(), before)),
        "shards differ after load",
    )
    world.group.barrier()
    if world.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def mixed_precision(world: Any, rep: Report) -> None:
    """bfloat16 gathers and compute, float32 master shards and reduction: loss near the float32 run."""
    import torch

    g = world.group
    seen: set[str] = set()
    losses = {}
    for mp in (None, pp.MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")):
        model = _model(seed=0, dtype=torch.float32)
        fsdp = pp.FSDP(model, g, "full_shard", mixed_precision=mp)
        if mp is not None:  # registered after FSDP's own pre-hook, so it sees the gathered weight
            model[2].register_forward_pre_hook(lambda m, a: seen.add(f"{a[0].dtype}/{m.weight.dtype}"))
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        fsdp.attach(opt)
        run = []
        for step in range(STEPS):
            x, y = _batch(step, world.rank, torch.float32)
            loss = torch.nn.functional.mse_loss(fsdp(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(float(loss.detach()))
        losses[mp is not None] = run
        rep.check(
            f"master shards stay float32 (mixed={mp is not None})",
            all(p.dtype == torch.float32 for p in fsdp.parameters()),
            str([p.dtype for p in fsdp.parameters()]),
        )
    rep.check("compute ran in bfloat16", seen == {"torch.bfloat16/torch.bfloat16"}, str(seen))
    rep.check(
        "bfloat16 losses within 3e-2 of float32's",
        all(abs(a - b) <= 3e-2 * max(abs(b), 1e-3) for a, b in zip(losses[True], losses[False])),
        str(losses),
    )


def errors(world: Any, rep: Report) -> None:
    import torch

    fsdp = pp.FSDP(_model(seed=0), world.group, "full_shard")
    rep.raises("backward on a torch module", RuntimeError, lambda: fsdp.backward(None), "loss.backward()")
    rep.raises("a foreign optimizer", ValueError, lambda: fsdp.attach(object()), "torch.optim optimizer")
    rep.raises("not a module", ValueError, lambda: pp.FSDP(object(), world.group), "torch.nn.Module")

    class Skips(torch.nn.Module):
        """Reads its second layer's weight without calling that layer: FSDP would not gather it."""

        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(3, 3).double()
            self.b = torch.nn.Linear(3, 3).double()

        def forward(self, x: Any) -> Any:
            return self.a(x) @ self.b.weight

    skipping = pp.FSDP(Skips(), world.group, "full_shard")
    rep.raises(
        "a unit module the forward never calls",
        RuntimeError,
        lambda: skipping(torch.ones(2, 3, dtype=torch.float64)),
        "did not call the module",
        "'b'",
    )


def scenario(world: Any, rep: Report) -> None:
    counter = Counting()
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        train(world, rep, counter, strategy)
    mixed_precision(world, rep)
    errors(world, rep)
    rep.values["num_checks"] = rep.num_checks


if __name__ == "__main__":
    run_rank(scenario)
