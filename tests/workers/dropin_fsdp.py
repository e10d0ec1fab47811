"""pp.FSDP as a drop-in for torch's FSDP on model code the project did not write (transformers GPT-2, Llama,
ResNet, torchvision's ResNet-18, timm's ViT: ``tm.MODELS``): the standard loop (``out = fsdp(**batch)``, ``loss.backward()``, ``fsdp.clip_grad_norm_``,
torch AdamW with param groups, ``step``, ``zero_grad(set_to_none=True)``) under each strategy given, with the
default units and with ``units_by_class(block)``. Every rank checks losses, gradient norms and the final
``fsdp.state_dict()`` against one process on the whole global batch (the models without BatchNorm, whose
statistics are per rank) and against torch's FSDP2 ``fully_shard`` over gloo on the same data (every model).

``focused``: the failures the drop-in fixes (tied weights in two units, the tied alias key, gradients final
when ``loss.backward()`` returns, a sharded parameter read outside its unit, checkpoint to a plain module).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank

import paramplane as pp

STEPS = 3
CLIP = 0.5
RTOL = {"gpt2": 1e-9, "resnet": 1e-9, "resnet18": 1e-9, "vit": 1e-9, "llama": 1e-5}
"""float64 models; Llama's RMSNorm computes in float32 (its rounding depends on the batch shape): float32 tolerance."""
ROOT = {"lr": 0.01, "weight_decay": 0.0}
BLOCKS = {"lr": 0.02, "weight_decay": 0.1}


def _block_names(model: Any) -> set[str]:
    cls = tm.block_class(model)
    return {
        f"{path}.{n}"
        for path, m in model.named_modules()
        if isinstance(m, cls)
        for n, _ in m.named_parameters()
    }


def _num_blocks(model: Any) -> int:
    return sum(1 for m in model.modules() if isinstance(m, tm.block_class(model)))


def _groups(model: Any, blocks: set[str] | None = None) -> list[dict[str, Any]]:
    """AdamW param groups of a plain (or FSDP2) model: block parameters and the rest."""
    blocks = _block_names(model) if blocks is None else blocks
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n not in blocks], **ROOT},
        {"params": [p for n, p in named if n in blocks], **BLOCKS},
    ]


_loss = tm.loss64


def _step(model: Any, opt: Any, kwargs: dict[str, Any], clip: Any) -> tuple[float, float]:
    loss = _loss(model, kwargs)
    loss.backward()
    norm = clip(CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach()), float(norm)


def _reference(name: str, n: int) -> tuple[list[float], list[float], dict[str, Any]]:
    """One process on the whole global batch: losses, gradient norms, final state."""
    import torch

    model = tm.build(name)
    opt = torch.optim.AdamW(_groups(model))
    clip = lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)  # noqa: E731
    runs = [_step(model, opt, tm.global_batch(name, s, n), clip) for s in range(STEPS)]
    return [r[0] for r in runs], [r[1] for r in runs], model.state_dict()


def _fsdp2(world: Any, name: str) -> tuple[list[float], list[float], dict[str, Any]]:
    """torch's FSDP2 over gloo, one fully_shard per block and one at the root: local losses, norms, state."""
    import torch
    from torch.distributed.fsdp import fully_shard

    tm.init_gloo(world)
    model = tm.build(name)
    blocks = _block_names(model)
    for m in [m for m in model.modules() if isinstance(m, tm.block_class(model))]:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(_groups(model, blocks))
    clip = lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c).full_tensor()  # noqa: E731
    runs = [_step(model, opt, tm.batch(name, s, world.rank), clip) for s in range(STEPS)]
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return [r[0] for r in runs], [r[1] for r in runs], state


def _close(a: float, b: float, rtol: float = 1e-9) -> bool:
    return abs(a - b) <= rtol * max(abs(b), 1e-12)


def _close_arrays(got: np.ndarray, want: np.ndarray, rtol: float = 1e-8) -> bool:
    """Equal shapes and a difference small against the array's norm (elementwise, tiny moments are noisy)."""
    if got.shape != want.shape:
        return False
    return float(np.linalg.norm(got - want)) <= rtol * max(float(np.linalg.norm(want)), 1e-30)


def _same_adamw_state(rep: Report, what: str, a: tuple[Any, Any], b: tuple[Any, Any]) -> None:
    """Two (FSDP, torch AdamW) pairs hold equal optimizer state, parameter by parameter."""
    import torch

    (fsdp_a, opt_a), (fsdp_b, opt_b) = a, b
    rep.check(
        what,
        all(
            torch.equal(opt_b.state[q][k], opt_a.state[p][k])
            for p, q in zip(fsdp_a.parameters(), fsdp_b.parameters())
            for k in ("exp_avg", "exp_avg_sq", "step")
        ),
    )


def _same_state(
    rep: Report, what: str, got: dict[str, Any], want: dict[str, Any], rtol: float = 1e-9
) -> None:
    rep.check(f"{what}: state_dict keys", list(got) == list(want), f"{list(got)[:5]} vs {list(want)[:5]}")
    bad = [
        k
        for k, v in want.items()
        if k not in got
        or not hasattr(got[k], "numpy")
        or tuple(got[k].shape) != tuple(v.shape)
        or not np.allclose(
            got[k].numpy(), v.detach().numpy(), rtol=rtol, atol=1e-12 if rtol <= 1e-9 else 1e-6
        )
    ]
    rep.check(f"{what}: every state value equal", not bad, f"differ: {bad[:5]}")


def _train(world: Any, rep: Report, name: str, strategy: str, by_class: bool) -> tuple[Any, ...]:
    """Our FSDP: global mean losses, local losses, norms and the final state."""
    import torch

    g, n = world.group, world.world_size
    model = tm.build(name)
    units = pp.units_by_class(tm.block_class(model)) if by_class else None
    fsdp = pp.FSDP(model, g, strategy, units=units)
    blocks = _block_names(model)
    kinds = {u.name: {nm in blocks for nm in u.names} for u in fsdp.units}
    what = f"{name}/{strategy}/{'by_class' if by_class else 'default'}"
    # by default (blocks in a ModuleList, or in Sequentials: torchvision's ResNet, timm's ViT) as by class
    rep.check(
        f"{what}: root unit holds the rest, block units their blocks",
        all(k == ({False} if u == "<root>" else {True}) for u, k in kinds.items()),
        str(kinds),
    )
    rep.check(f"{what}: a unit per block", len(kinds) - 1 == _num_blocks(model), str(kinds))
    # AdamW groups as the reference's: a unit's shard goes with its parameters' group (blocks or the rest)
    shards = {u.name: p for u, p in zip(fsdp.units, fsdp.parameters())}
    opt = torch.optim.AdamW(
        [
            {"params": [p for u, p in shards.items() if kinds[u] != {True}], **ROOT},
            {"params": [p for u, p in shards.items() if kinds[u] == {True}], **BLOCKS},
        ]
    )
    means, local, norms = [], [], []
    for s in range(STEPS):
        loss, norm = _step(fsdp, opt, tm.batch(name, s, world.rank), fsdp.clip_grad_norm_)
        total = np.array([loss])
        g.all_reduce(total, "sum")
        means.append(float(total[0]) / n)
        local.append(loss)
        norms.append(norm)
    return means, local, norms, fsdp.state_dict()


def train(world: Any, rep: Report, strategies: list[str]) -> None:
    n = world.world_size
    for name in tm.MODELS:
        tol = RTOL[name]
        ref = _reference(name, n) if name not in tm.BATCHNORM_MODELS else None
        theirs = _fsdp2(world, name)
        trained = {k for k, _ in tm.build(name).named_parameters(remove_duplicate=False)}
        for strategy in strategies:
            for by_class in (False, True):
                what = f"{name}/{strategy}/{'by_class' if by_class else 'default'}"
                means, local, norms, state = _train(world, rep, name, strategy, by_class)
                # the trained parameters, alike on every rank (the test compares; BatchNorm's statistics are not)
                rep.digests[what] = digest(
                    np.concatenate(
                        [state[k].double().reshape(-1).numpy() for k in sorted(state) if k in trained]
                    )
                )
                rep.check(f"{what}: clipping happened", all(x > CLIP for x in norms), str(norms))
                if ref is not None:
                    rep.check(
                        f"{what}: losses = one process",
                        all(_close(a, b, tol) for a, b in zip(means, ref[0])),
                        f"{means} {ref[0]}",
                    )
                    rep.check(
                        f"{what}: norms = one process",
                        all(_close(a, b, tol) for a, b in zip(norms, ref[1])),
                        f"{norms} {ref[1]}",
                    )
                    if (
                        name != "llama"
                    ):  # Adam magnifies its float32 RMSNorm's rounding; equal to FSDP2's below
                        _same_state(rep, f"{what} vs one process", state, ref[2], tol)
                if theirs is not None:
                    rep.check(
                        f"{what}: losses = FSDP2",
                        all(map(_close, local, theirs[0])),
                        f"{local} {theirs[0]}",
                    )
                    rep.check(
                        f"{what}: norms = FSDP2",
                        all(map(_close, norms, theirs[1])),
                        f"{norms} {theirs[1]}",
                    )
                    _same_state(rep, f"{what} vs FSDP2", state, theirs[2])


def focused(world: Any, rep: Report) -> None:
    import torch

    g, n = world.group, world.world_size
    want = _reference("gpt2", n)
    # Tied weights split across units: the embedding's and the head's users in different units (the head
    # alone a unit, or both): the shared weight goes to the root unit, and training equals one process.
    for label, pick in (
        ("head unit", lambda m: [m.lm_head]),
        ("wte and head units", lambda m: [m.transformer.wte, m.lm_head]),
    ):
        model = tm.build("gpt2")
        fsdp = pp.FSDP(model, g, "full_shard", units=pick(model))
        root = next(u for u in fsdp.units if u.name == "<root>")
        rep.check(
            f"{label}: tied weight owned by the root", "transformer.wte.weight" in root.names, str(root.names)
        )
        opt = torch.optim.AdamW(fsdp.parameters(), lr=0.01, weight_decay=0.0)
        loss = _loss(fsdp, tm.batch("gpt2", 0, world.rank))
        loss.backward()
        total = np.array([float(loss.detach())])
        g.all_reduce(total, "sum")
        rep.check(
            f"{label}: first loss = one process",
            _close(float(total[0]) / n, want[0][0]),
            f"{total[0] / n} vs {want[0][0]}",
        )
        opt.step()

    # use_orig_params: the optimizer sees one piece per module parameter, by name, so param groups by name
    # (no weight decay on biases and LayerNorms, as torch users write them) train equal to one process; the
    # optimizer's state of the pieces round-trips through a checkpoint into a fresh wrapper and optimizer.
    def by_name(named: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        plain = [n.endswith(".bias") or ".ln_" in n for n, _ in named]
        return [
            {"params": [p for (_, p), skip in zip(named, plain) if not skip], "weight_decay": 0.1},
            {"params": [p for (_, p), skip in zip(named, plain) if skip], "weight_decay": 0.0},
        ]

    fsdp = pp.FSDP(tm.build("gpt2"), g, "full_shard", use_orig_params=True)
    ref = tm.build("gpt2")
    rep.check(
        "use_orig_params: the module's parameter names",
        sorted(n for n, _ in fsdp.named_parameters()) == sorted(n for n, _ in ref.named_parameters()),
        str([n for n, _ in fsdp.named_parameters()][:3]),
    )
    opt = torch.optim.AdamW(by_name(list(fsdp.named_parameters())), lr=0.01)
    ref_opt = torch.optim.AdamW(by_name(list(ref.named_parameters())), lr=0.01)
    for step in range(STEPS):
        loss, _ = _step(fsdp, opt, tm.batch("gpt2", step, world.rank), fsdp.clip_grad_norm_)
        total = np.array([loss])
        g.all_reduce(total, "sum")
        ref_loss = sum(_loss(ref, tm.batch("gpt2", step, r)) for r in range(n)) / n
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        rep.check(
            f"use_orig_params step {step}: loss = one process",
            _close(float(total[0]) / n, float(ref_loss)),
            f"{total[0] / n} vs {float(ref_loss)}",
        )
    _same_state(rep, "use_orig_params: parameters = one process", fsdp.state_dict(), ref.state_dict())
    orig_dir = Path(tempfile.gettempdir()) / f"pp-dropin-orig-{world.job_id}"
    saved = pp.checkpoint.save({"model": fsdp, "optim": fsdp.optim_state(opt)}, orig_dir, g)
    again = pp.FSDP(tm.build("gpt2", seed=4), g, "full_shard", use_orig_params=True)
    again_opt = torch.optim.AdamW(by_name(list(again.named_parameters())), lr=0.01)
    pp.checkpoint.load({"model": again, "optim": again.optim_state(again_opt)}, saved, g)
    _same_adamw_state(
        rep, "use_orig_params: optimizer state round-trips by parameter", (fsdp, opt), (again, again_opt)
    )
    g.barrier()
    if world.rank == 0:
        shutil.rmtree(orig_dir, ignore_errors=True)

    # A torch optimizer's state over the shards (fsdp.optim_state): consolidated from a checkpoint it equals
    # one process's AdamW state by parameter name, and it loads into a fresh optimizer over a fresh wrapper.
    fsdp = pp.FSDP(tm.build("gpt2"), g, "full_shard")
    opt = torch.optim.AdamW(fsdp.parameters(), lr=0.01, weight_decay=0.0)
    _loss(fsdp, tm.batch("gpt2", 0, world.rank)).backward()
    opt.step()
    ref = tm.build("gpt2")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    (sum(_loss(ref, tm.batch("gpt2", 0, r)) for r in range(n)) / n).backward()
    ref_opt.step()
    from paramplane.checkpoint.__main__ import consolidate

    ckpt_dir = Path(tempfile.gettempdir()) / f"pp-dropin-optim-{world.job_id}"
    saved = pp.checkpoint.save({"model": fsdp, "optim": fsdp.optim_state(opt)}, ckpt_dir, g)
    fresh = pp.FSDP(tm.build("gpt2", seed=9), g, "full_shard")
    # built with other hyperparameters: the checkpoint's (param_groups) replace them
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5, betas=(0.5, 0.6), eps=1e-3, weight_decay=0.2)
    pp.checkpoint.load({"model": fresh, "optim": fresh.optim_state(fresh_opt)}, saved, g)
    _same_adamw_state(rep, "optimizer state loads into a fresh optimizer", (fsdp, opt), (fresh, fresh_opt))
    groups = [opt.state_dict()["param_groups"], fresh_opt.state_dict()["param_groups"]]
    rep.check(
        "optimizer hyperparameters load with the state",
        groups[0] == groups[1] and groups[1][0]["betas"] == (0.9, 0.999),
        str(groups[1][0]),
    )
    if world.rank == 0:
        out_npz = ckpt_dir.with_suffix(".npz")
        consolidate(Path(saved), out_npz)
        arrays = np.load(out_npz)
        for name, p in ref.named_parameters():
            for moment in ("exp_avg", "exp_avg_sq"):
                key = f"optim/state.{name}.{moment}"
                got = arrays[key] if key in arrays.files else None
                rep.check(
                    f"consolidated {moment} of {name} = one process's",
                    got is not None and _close_arrays(got, ref_opt.state[p][moment].numpy()),
                    key,
                )
        out_npz.unlink()
    g.barrier()
    if world.rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)

    # Gradients final when loss.backward() returns (no attach): the global norm matches one process;
    # torch's helper over the shards sees only this rank's shards (documented as wrong).
    model = tm.build("gpt2")
    fsdp = pp.FSDP(model, g, "full_shard")
    _loss(fsdp, tm.batch("gpt2", 0, world.rank)).backward()
    rep.check(
        "every shard's grad set when backward returns", all(p.grad is not None for p in fsdp.parameters()), ""
    )
    local = float(
        torch.nn.utils.clip_grad_norm_(fsdp.parameters(), float("inf"))
    )  # inf: measures, clips nothing
    local2 = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in fsdp.parameters()])))
    norm = float(fsdp.clip_grad_norm_(CLIP))
    rep.check(
        "fsdp.clip_grad_norm_ = one process's norm", _close(norm, want[1][0]), f"{norm} vs {want[1][0]}"
    )
    rep.check(
        "torch's clip_grad_norm_ over shards is this rank's norm only",
        local2 < norm * (1 - 1e-6),
        f"{local2} vs {norm}",
    )
    rep.values["local_vs_global_norm"] = [local2, norm, local]

    # A sharded parameter read outside its unit is NaN (a placeholder), never plausible values such as zeros.
    weight = model.transformer.h[0].mlp.c_fc.weight
    rep.check("a sharded parameter reads as NaN", bool(weight.isnan().all()), str(weight.flatten()[:3]))

    # State dicts: the tied alias key, strict both ways; a missing or unexpected key is named.
    sd = fsdp.state_dict()
    plain = tm.build("gpt2", seed=7)
    rep.check("state keys = module.state_dict()'s", list(sd) == list(plain.state_dict()), str(list(sd)[-3:]))
    rep.check("alias present", "lm_head.weight" in sd, "")
    plain.load_state_dict(sd, strict=True)
    rep.check(
        "plain module loads fsdp.state_dict() strictly",
        torch.equal(plain.lm_head.weight, sd["transformer.wte.weight"]),
        "",
    )
    other = tm.build("gpt2", seed=3)
    fsdp.load_state_dict(other.state_dict())
    _same_state(rep, "plain state_dict loaded into FSDP", fsdp.state_dict(), other.state_dict())
    fsdp.load_state_dict({k: v.numpy() for k, v in other.state_dict().items()})
    part = dict(other.state_dict())
    part.pop("lm_head.weight")
    rep.raises("missing key named", ValueError, lambda: fsdp.load_state_dict(part), "lm_head.weight")
    rep.raises(
        "unexpected key named",
        ValueError,
        lambda: fsdp.load_state_dict({**sd, "extra.w": sd["lm_head.weight"]}),
        "extra.w",
    )

    # A checkpoint of the wrapped model, consolidated, loads strictly into a plain torch module.
    from paramplane.checkpoint.__main__ import consolidate

    root_dir = Path(tempfile.gettempdir()) / f"pp-dropin-{world.job_id}"
    saved = pp.checkpoint.save({"model": fsdp}, root_dir, g)
    g.barrier()
    if world.rank == 0:
        out_npz = root_dir.with_suffix(".npz")
        consolidate(Path(saved), out_npz)
        arrays = np.load(out_npz)
        fresh = tm.build("gpt2", seed=5)
        fresh.load_state_dict(
            {k.removeprefix("model/"): torch.from_numpy(arrays[k]) for k in arrays.files}, strict=True
        )
        _same_state(rep, "consolidated checkpoint in a plain module", fresh.state_dict(), other.state_dict())
        out_npz.unlink()
    g.barrier()
    if world.rank == 0:
        shutil.rmtree(root_dir, ignore_errors=True)


def checkpointing(world: Any, rep: Report) -> None:
    """Activation checkpointing as transformers users turn it on (``gradient_checkpointing_enable``: each
    block's forward runs again inside the backward), reentrant and not, under pp.DDP and pp.FSDP: every step's
    loss and the final parameters equal one process on the whole batch with the same checkpointing."""
    import torch

    n = world.world_size
    for reentrant in (False, True):
        for how in ("ddp", "full_shard", "shard_grad_op", "full_shard/mlp"):
            what = f"checkpointed ({'reentrant' if reentrant else 'non-reentrant'}) {how}"
            models = [tm.build("gpt2"), tm.build("gpt2")]
            for m in models:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
                m.train()
            ref, model = models
            calls: list[int] = []
            # transformers checkpoints a block's forward, not its call: hooks on the block run once, on what it
            # calls again in the backward (its attention) twice
            model.transformer.h[0].attn.register_forward_hook(lambda *_, c=calls: c.append(1))
            if how == "ddp":
                wrapped = pp.DDP(model, world.group)
            else:  # "/mlp": units inside the checkpointed blocks, so their hooks run again in the backward
                mlp = type(model.transformer.h[0].mlp)
                units = pp.units_by_class(mlp) if how.endswith("/mlp") else None
                wrapped = pp.FSDP(model, world.group, how.split("/")[0], units=units)
            finishes: list[int] = []
            inner_finish = wrapped.finish_gradient_sync

            def finish(f: list[int] = finishes, inner: Any = inner_finish) -> None:
                f.append(1)
                inner()

            wrapped.finish_gradient_sync = finish  # type: ignore[method-assign]
            opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ref, wrapped)]
            for s in range(STEPS):
                losses = [
                    _loss(ref, tm.global_batch("gpt2", s, n)),
                    _loss(wrapped, tm.batch("gpt2", s, world.rank)),
                ]
                for loss, opt in zip(losses, opts):
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                total = np.array([float(losses[1].detach())])
                world.group.all_reduce(total, "sum")
                rep.check(
                    f"{what}: loss {s} = one process",
                    _close(float(total[0]) / n, float(losses[0].detach())),
                    f"{total[0] / n} {float(losses[0])}",
                )
            rep.check(f"{what}: blocks ran again in the backward", len(calls) == 2 * STEPS, str(len(calls)))
            # once per backward, at its end: not at the end of each block's nested backward (reentrant)
            rep.check(
                f"{what}: the sync finished once per backward", len(finishes) == STEPS, str(len(finishes))
            )
            state = wrapped.state_dict() if how != "ddp" else model.state_dict()
            _same_state(rep, f"{what} vs one process", state, ref.state_dict())
            if how == "ddp":
                wrapped.remove_hooks()


def scenario(world: Any, rep: Report) -> None:
    mode = sys.argv[1]
    if mode == "focused":
        focused(world, rep)
    elif mode == "checkpointing":
        checkpointing(world, rep)
    else:
        train(world, rep, mode.split(","))
    rep.values["num_checks"] = rep.num_checks


if __name__ == "__main__":
    run_rank(scenario)
