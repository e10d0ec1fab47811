"""pp.DDP as a drop-in for torch's DistributedDataParallel, with the loop torch users already have.

``issue``: issue 25's items 1-2 on a small model: ``.grad`` is averaged when ``loss.backward()`` returns, so
``clip_grad_norm_`` between backward and step clips the averaged gradient and the step uses it.

``models``: for transformers GPT-2, Llama (tied embeddings, ``ModelOutput``) and ResNet (BatchNorm buffers),
torchvision's ResNet-18 and timm's ViT (``tm.MODELS``),
``out = ddp(**batch)``, ``out.loss.backward()``, ``clip_grad_norm_`` (really clipping), AdamW with a decay
and a no-decay group and an LR scheduler, ``zero_grad(set_to_none=True)``; every step's losses and the final
parameters equal one process on the whole batch and torch's own DDP over gloo. Then ``no_sync``
accumulation, a submodule unused on every rank and on one rank, a call with positional and keyword
arguments, and bfloat16 autocast on a float32 model, against one process and torch's DDP.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank

import paramplane as pp

STEPS = 3
CLIP = 0.05  # far below every model's gradient norm here: clipping happens in every step (checked)
# Tolerance against one process: Llama's RMSNorm, rotary embedding and eager softmax compute in float32
# whatever the model's dtype, so a different batch split rounds differently there (torch's DDP, doing the
# same local arithmetic, is held to 1e-12 for every model).
ONE_PROCESS_RTOL = {"gpt2": 1e-9, "llama": 1e-5, "resnet": 1e-9, "resnet18": 1e-9, "vit": 1e-9}
BUCKET_MB = 0.002  # several buckets, so all-reduces start while backward runs


# -- issue 25 items 1-2 ---------------------------------------------------------------------------------
def _small(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def _xy(step: int, rank: int) -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(step * 100 + rank)
    return torch.from_numpy(rng.standard_normal((4, 5))), torch.from_numpy(rng.standard_normal((4, 3)))


def issue(world: Any, rep: Report) -> None:
    import torch

    n = world.world_size
    model = _small(seed=world.rank)
    ddp = pp.DDP(model, world.group, bucket_mb=0.0002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    ddp.attach(opt)  # still accepted (a no-op wait now); the sync must not depend on it
    ref = _small(seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(STEPS):
        x, y = _xy(step, world.rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        xs, ys = zip(*(_xy(step, r) for r in range(n)))
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        rep.equal(f"step {step}: grads averaged when backward returns", tm.flat_grads(model),
                  tm.flat_grads(ref), rtol=1e-10)  # fmt: skip
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        rep.check(f"step {step}: clipping happens", float(norm) > 2 * CLIP, f"norm {float(norm)}")
        rep.equal(f"step {step}: global norm", norm.numpy(), ref_norm.numpy(), rtol=1e-10)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        rep.equal(f"step {step}: clipped step equals one process", tm.flat_params(model), tm.flat_params(ref),
                  rtol=1e-10)  # fmt: skip
    rep.digests["issue"] = digest(tm.flat_params(model))


# -- no_sync, unused submodules, positional and keyword arguments, autocast ----------------------------------
def _net(seed: int) -> Any:
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(4, 8)
            self.extra = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x: Any, y: Any, scale: float = 1.0, *, skip_extra: bool = False) -> Any:
            h = torch.tanh(self.embed(x))
            if not skip_extra:
                h = h + torch.tanh(self.extra(h))
            out = self.head(h) * scale
            return out, torch.nn.functional.mse_loss(out, y)

    torch.manual_seed(seed)
    return Net().double()


def _calls(step: int, rank: int) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Rank ``rank``'s micro-batches of step ``step`` as (args, kwargs): step 0 accumulates two (the first
    under ``no_sync``), step 1 skips ``extra`` on every rank, step 2 on rank 0 only."""
    import torch

    def xy(k: int) -> tuple[Any, Any]:
        rng = np.random.default_rng(10_000 + 100 * step + 10 * rank + k)
        return torch.from_numpy(rng.standard_normal((3, 4))), torch.from_numpy(rng.standard_normal((3, 3)))

    if step == 0:
        return [(xy(0), {}), (xy(1), {})]
    if step == 1:
        return [((*xy(0), 0.5), {"skip_extra": True})]
    return [(xy(0), {"scale": 2.0, "skip_extra": rank == 0})]


def _grad_list(model: Any) -> list[np.ndarray | None]:
    return [None if p.grad is None else p.grad.numpy().copy() for p in model.parameters()]


def _extras(world: Any, rep: Report, as_view: bool = False) -> None:
    """``as_view``: both DDPs with ``gradient_as_bucket_view=True``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    n, rank = world.world_size, world.rank
    model, ref = _net(seed=rank), _net(seed=0)
    kw = {"find_unused_parameters": True, "gradient_as_bucket_view": as_view}
    ddp = pp.DDP(model, process_group=world.group, bucket_mb=0.0002, **kw)  # torch's keyword for the group
    theirs = DistributedDataParallel(_net(seed=0), **kw)
    opts = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (model, ref, theirs.module)]
    for step, what in enumerate(
        ("no_sync accumulation", "extra unused on every rank", "extra unused on rank 0")
    ):
        for wrapper in (ddp, theirs):
            calls = _calls(step, rank)
            for k, (args, kwargs) in enumerate(calls):
                with wrapper.no_sync() if k < len(calls) - 1 else contextlib.nullcontext():
                    wrapper(*args, **kwargs)[1].backward()
        sum(ref(*a, **kw)[1] for r in range(n) for a, kw in _calls(step, r)).div(n).backward()
        got, want, torch_got = _grad_list(model), _grad_list(ref), _grad_list(theirs.module)
        if as_view:  # the gradients are held once: in the buckets
            flats = [b.flat for b in ddp._buckets]
            rep.check(
                f"{what}: every gradient is a view of a bucket",
                all(
                    p.grad is None or any(np.shares_memory(p.grad.numpy(), f) for f in flats)
                    for p in model.parameters()
                ),
            )
        what = f"{what}{' (gradient_as_bucket_view)' if as_view else ''}"
        for i, (name, _) in enumerate(model.named_parameters()):
            same_none = (got[i] is None) == (want[i] is None) == (torch_got[i] is None)
            none_ok = rep.check(f"{what}: {name}.grad is None as in one process and torch DDP", same_none)
            if none_ok and got[i] is not None:
                rep.equal(f"{what}: {name}.grad equals one process", got[i], want[i], rtol=1e-12)
                rep.equal(f"{what}: {name}.grad equals torch DDP", got[i], torch_got[i], rtol=1e-12)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        rep.close(f"{what}: parameters equal one process", tm.flat_params(model), tm.flat_params(ref), 1e-12)
    rep.check("extra's grad stays None when no rank used it", model.extra.weight.grad is None)  # after step 1
    rep.digests[f"extras{' as view' if as_view else ''}"] = digest(tm.flat_params(model))
    ddp.remove_hooks()


def _autocast(world: Any, rep: Report) -> None:
    """bfloat16 autocast on a float32 GPT-2: the same local arithmetic as torch's DDP, so only the gradient
    averaging's rounding separates the two (compared at a bfloat16 tolerance)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    def loss_of(wrapper: Any) -> Callable[[int], Any]:
        def run(step: int) -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return wrapper(**tm.batch("gpt2", step, world.rank)).loss

        return run

    model = tm.build("gpt2", seed=world.rank, dtype=torch.float32)
    ddp = pp.DDP(model, world.group, bucket_mb=BUCKET_MB)
    theirs = DistributedDataParallel(tm.build("gpt2", seed=0, dtype=torch.float32))
    losses, _ = _loop(model, list(ddp.parameters()), loss_of(ddp), steps=2)
    t_losses, _ = _loop(theirs.module, list(theirs.parameters()), loss_of(theirs), steps=2)
    rep.equal("autocast: losses equal torch DDP", losses, t_losses, rtol=1e-2)
    rep.close(
        "autocast: parameters equal torch DDP", tm.flat_params(model), tm.flat_params(theirs.module), 1e-3
    )
    rep.values["autocast error"] = float(np.abs(tm.flat_params(model) - tm.flat_params(theirs.module)).max())
    ddp.remove_hooks()


# -- third-party models, the standard loop --------------------------------------------------------------
def _optimizer(model: Any) -> tuple[Any, Any]:
    """AdamW with weight decay on weights, none on biases and norms (chosen by name), and an LR schedule."""
    import torch

    groups: tuple[list[Any], list[Any]] = ([], [])
    for name, p in model.named_parameters():
        groups["bias" in name or "norm" in name or "ln_" in name].append(p)
    assert groups[0] and groups[1], "both param groups must be non-empty"
    opt = torch.optim.AdamW(
        [{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}], lr=1e-2
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _loop(model: Any, params: list[Any], loss_of: Callable[[int], Any], steps: int = STEPS) -> Any:
    """The loop a torch user writes; returns each step's loss and pre-clipping gradient norm."""
    import torch

    opt, sched = _optimizer(model)
    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(step)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return np.array(losses), np.array(norms)


def _build(name: str, seed: int) -> Any:
    """``tm.build`` in float64, with the causal LMs' loss kept in float64: transformers' own casts the logits
    to float32, which would hold every comparison to float32's precision."""
    import torch

    model = tm.build(name, seed)
    if name not in tm.IMAGE_MODELS:

        def loss(logits: Any, labels: Any, vocab_size: int, **_: Any) -> Any:
            shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            return torch.nn.functional.cross_entropy(logits.view(-1, vocab_size), shifted.reshape(-1))

        model.loss_function = loss
    return model


def _one_process_loss(model: Any, name: str, step: int, n: int) -> Any:
    """One process on the whole batch: BatchNorm's statistics are per rank in DDP (torch's too), so ResNet's
    reference runs each rank's shard in its own forward and averages the losses."""
    if name in tm.BATCHNORM_MODELS:
        return sum(tm.image_loss(model, tm.batch(name, step, r)) for r in range(n)) / n
    if name in tm.IMAGE_MODELS:
        return tm.image_loss(model, tm.global_batch(name, step, n))
    return model(**tm.global_batch(name, step, n)).loss


def _loss(model: Any, name: str, step: int, rank: int) -> Any:
    """This rank's loss at ``step`` (``model``: the module or a DDP around it)."""
    if name in tm.IMAGE_MODELS:
        return tm.image_loss(model, tm.batch(name, step, rank))
    return model(**tm.batch(name, step, rank)).loss


def models(world: Any, rep: Report) -> None:
    tm.init_gloo(world)
    for name in tm.MODELS:
        _standard_loop(world, rep, name)
    _extras(world, rep)
    _extras(world, rep, as_view=True)
    _autocast(world, rep)


def _standard_loop(world: Any, rep: Report, name: str) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    g, n, rank = world.group, world.world_size, world.rank
    model = _build(name, seed=rank)  # differs per rank: the wrap-time broadcast makes it rank 0's
    ddp = pp.DDP(model, g, bucket_mb=BUCKET_MB)
    rep.check(f"{name}: several buckets", ddp.num_buckets > 1, str(ddp.num_buckets))
    losses, norms = _loop(model, list(ddp.parameters()), lambda s: _loss(ddp, name, s, rank))
    ref = _build(name, seed=0)
    ref_losses, ref_norms = _loop(ref, list(ref.parameters()), lambda s: _one_process_loss(ref, name, s, n))
    theirs = DistributedDataParallel(_build(name, seed=0))
    t_losses, t_norms = _loop(
        theirs.module, list(theirs.parameters()), lambda s: _loss(theirs, name, s, rank)
    )
    rep.check(f"{name}: clipping happens every step", bool((norms > 2 * CLIP).all()), str(norms))
    mean_losses = g.all_reduce(losses.copy(), "mean")
    rtol = ONE_PROCESS_RTOL[name]
    rep.equal(f"{name}: mean loss equals one process", mean_losses, ref_losses, rtol=rtol)
    rep.equal(f"{name}: global grad norms equal one process", norms, ref_norms, rtol=rtol)
    rep.equal(f"{name}: losses equal torch DDP", losses, t_losses, rtol=1e-12)
    rep.equal(f"{name}: grad norms equal torch DDP", norms, t_norms, rtol=1e-12)
    mine = tm.flat_params(model)
    rep.close(f"{name}: parameters equal one process", mine, tm.flat_params(ref), rtol)
    rep.close(f"{name}: parameters equal torch DDP", mine, tm.flat_params(theirs.module), 1e-12)
    keys_same = list(ddp.state_dict()) == list(theirs.module.state_dict())
    rep.check(f"{name}: state_dict keys are the module's", keys_same)
    for (key, b), t in zip(model.named_buffers(), theirs.module.buffers(), strict=True):
        # relative to the buffer's norm: running means have entries near zero, where three ranks' summation
        # orders (ours, gloo's) leave differences in the last digits
        rep.close(f"{name}: buffer {key} equals torch DDP's", b.double().numpy(), t.double().numpy(), 1e-12)
    if name in tm.BATCHNORM_MODELS:  # an eval forward after training: torch broadcasts rank 0's statistics
        ddp.eval()
        theirs.eval()
        with torch.no_grad():
            logits = tm.image_logits(ddp, tm.batch(name, 99, 0)).numpy()
            want = tm.image_logits(theirs, tm.batch(name, 99, 0)).numpy()
        rep.equal(f"{name}: eval logits equal torch DDP's", logits, want, rtol=1e-12)
        rep.digests[f"{name} eval logits"] = digest(logits)  # the same on every rank (the test compares)
    rep.digests[name] = digest(mine)
    ddp.remove_hooks()


MODES: dict[str, Callable[[Any, Report], None]] = {"issue": issue, "models": models}

if __name__ == "__main__":
    run_rank(MODES[sys.argv[1]])
