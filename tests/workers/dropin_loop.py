"""What users' loops do with a wrapped model beyond forward/backward/step, on transformers' GPT-2 (world 2).

``ddp``: nanoGPT's accumulation (``model.require_backward_grad_sync = last_micro_step``) against one process and
torch's DDP doing the same (a micro-step's backward stays local, the last one averages the sum); the module's
attributes through the wrapper (``config``, ``named_modules``, ``training``, ``generate``), methods returning
the module keep the wrapper, moving it after wrapping is refused.

``fsdp``: the module called directly (``fsdp.module(...)``, ``fsdp.generate(...)``) gathers as ``fsdp(...)``
does (it used to compute with NaN placeholders); a sharded submodule called alone and ``module.state_dict()``
raise instead of computing with or saving placeholders, an optimizer over the module's own parameters refuses
to step (it would never see a gradient); inside ``summon_full_params()`` rank 0 alone samples
and ``module.state_dict()`` holds the full state; FSDP2's accumulation recipe (``set_requires_gradient_sync``,
``set_reshard_after_backward``, ``set_is_last_backward``) accumulates like one process, its
``set_gradient_divide_factor(1.0)`` sums and ``set_reshard_after_forward(False)`` keeps units gathered until the
backward, ``unshard()`` / ``reshard()`` hold the full parameters between them; transformers' ``save_pretrained``
inside ``summon_full_params()`` writes the full model (on the wrapper it refuses); mixed precision casts keyword inputs too (GPT-2's ``inputs_embeds=``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank

import paramplane as pp

MICRO = 2  # micro-steps per optimizer step
STEPS = 2


def _micro(step: int, micro: int, rank: int) -> dict[str, Any]:
    return tm.batch("gpt2", 100 * step + micro, rank)


def _reference_step(ref: Any, opt: Any, step: int, num_ranks: int) -> None:
    """One process on every rank's micro-batches: the mean of their losses (each micro-batch's loss divided
    by the number of micro-steps, as nanoGPT does, and averaged over ranks, as DDP does)."""
    for micro in range(MICRO):
        for r in range(num_ranks):
            (ref(**_micro(step, micro, r)).loss / (MICRO * num_ranks)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _grad_sum(model: Any) -> float:
    return float(sum(float(p.grad.sum()) for p in model.parameters() if p.grad is not None))


def _differs_across_ranks(world: Any, value: float) -> bool:
    got = world.group.all_gather(np.array([value]))
    return bool(got.max() - got.min() > 1e-9 * max(1.0, abs(float(got.max()))))


def _fsdp2_setters(world: Any, rep: Report, fsdp: Any, batch: dict[str, Any]) -> None:
    """FSDP2's ``set_gradient_divide_factor`` (1.0: the sum, n times the mean) and ``set_reshard_after_forward``
    (False: the units stay gathered from the forward to the backward; the gradients unchanged); ``unshard`` /
    ``reshard``."""
    import torch

    n = world.world_size

    def grads(factor: float, reshard: bool) -> tuple[list[Any], int]:
        fsdp.set_gradient_divide_factor(factor)
        fsdp.set_reshard_after_forward(reshard)
        loss = fsdp(**batch).loss
        held = fsdp.memory_stats()["params_gathered"]["current"]
        loss.backward()
        fsdp.finish_gradient_sync()
        out = [p.grad.clone() for p in fsdp.parameters()]
        fsdp.zero_grad(set_to_none=True)
        return out, held

    mean, held_resharded = grads(float(n), True)
    summed, held_kept = grads(1.0, False)
    rep.check(
        "divide factor 1.0: the sum of the ranks' gradients",
        all(bool((s - n * m).abs().max() <= 1e-12 * (1 + m.abs().max())) for s, m in zip(summed, mean)),
    )
    rep.check(
        "reshard_after_forward=False keeps the units gathered until the backward",
        held_kept > held_resharded,
        f"{held_kept} vs {held_resharded} bytes",
    )
    fsdp.set_gradient_divide_factor(float(n))
    fsdp.set_reshard_after_forward(True)
    rep.raises("a divide factor of 0", ValueError, lambda: fsdp.set_gradient_divide_factor(0), "positive")
    rep.raises(
        "prefetching a module of no unit",
        ValueError,
        lambda: fsdp.set_modules_to_forward_prefetch([object()]),
        "not modules of this FSDP's units",
    )
    fsdp.set_modules_to_forward_prefetch([fsdp.units[1].module])

    # unshard(): the parameters readable (and a block callable alone) until reshard()
    ref = fsdp.state_dict()
    layer = fsdp.module.transformer.h[0].attn.c_attn
    x = torch.ones(1, 2, layer.weight.shape[0], dtype=torch.float64)
    fsdp.unshard(async_op=True).wait()
    rep.check(
        "unshard(): the full parameters in the module",
        torch.equal(layer.weight.detach(), ref["transformer.h.0.attn.c_attn.weight"]),
    )
    with torch.no_grad():
        rep.check("unshard(): a block's layer runs alone", torch.isfinite(layer(x)).all().item())
        rep.check("unshard(): a forward as without it", torch.isfinite(fsdp(**batch).logits).all().item())
    fsdp.reshard()
    rep.raises("reshard(): sharded again", RuntimeError, lambda: layer(x), "sharded")


def _save_pretrained(world: Any, rep: Report, fsdp: Any) -> None:
    """transformers' ``save_pretrained`` under pp.FSDP: called on the wrapper it refuses (the module's state
    would hold placeholders) and names ``fsdp.state_dict()``; inside ``summon_full_params()`` rank 0 writes the
    full model, which ``from_pretrained`` loads back equal to ``fsdp.state_dict()`` on every rank."""
    import os

    import torch
    from transformers import GPT2LMHeadModel

    where = os.path.join(os.environ["PARAMPLANE_TEST_OUT"], "pretrained")
    rep.raises("save_pretrained on the sharded module", RuntimeError, lambda: fsdp.save_pretrained(where),
               "fsdp.state_dict()")  # fmt: skip
    with fsdp.summon_full_params():
        fsdp.module.save_pretrained(where, is_main_process=world.rank == 0)
    world.barrier()
    loaded = GPT2LMHeadModel.from_pretrained(where, dtype=torch.float64).state_dict()
    full = fsdp.state_dict()
    rep.check("from_pretrained = fsdp.state_dict()", all(torch.equal(loaded[k], full[k]) for k in full))


def ddp_loop(world: Any, rep: Report) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    tm.init_gloo(world)
    n = world.world_size
    model = tm.build("gpt2", seed=0)
    ddp = pp.DDP(model, world.group)
    theirs = DistributedDataParallel(tm.build("gpt2", seed=0))
    ref = tm.build("gpt2", seed=0)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ddp, theirs, ref)]
    for step in range(STEPS):
        for micro in range(MICRO):
            last = micro == MICRO - 1
            for wrapped in (ddp, theirs):  # nanoGPT's loop, word for word
                wrapped.require_backward_grad_sync = last
                (wrapped(**_micro(step, micro, world.rank)).loss / MICRO).backward()
            if not last:
                local = _grad_sum(model)
                rep.check(
                    f"step {step}: a micro-step's backward stays local", _differs_across_ranks(world, local)
                )
                rep.equal(f"step {step}: local gradient as torch's DDP", np.array([local]),
                          np.array([_grad_sum(theirs.module)]), rtol=1e-10)  # fmt: skip
        rep.check(f"step {step}: flag reads back", ddp.require_backward_grad_sync is True)
        rep.equal(f"step {step}: averaged gradients as torch's DDP", tm.flat_grads(model),
                  tm.flat_grads(theirs.module), rtol=1e-10)  # fmt: skip
        for opt in opts[:2]:
            opt.step()
            opt.zero_grad(set_to_none=True)
        _reference_step(ref, opts[2], step, n)
        rep.close(
            f"step {step}: parameters equal one process", tm.flat_params(model), tm.flat_params(ref), 1e-9
        )
    try:
        ddp.require_backward_grad_sync = 1  # type: ignore[assignment]
        rep.check("a non-bool flag is refused", False)
    except ValueError:
        rep.check("a non-bool flag is refused", True)

    # the module's own attributes through the wrapper
    rep.check("parameters() is an iterator, as torch's", next(ddp.parameters()) is next(model.parameters()))
    rep.check("config", ddp.config is model.config)
    rep.check("named_modules", [k for k, _ in ddp.named_modules()] == [k for k, _ in model.named_modules()])
    ddp.eval()
    rep.check("training follows eval()", ddp.training is False and model.training is False)
    ddp.train()
    rep.check("apply returns the wrapper", ddp.apply(lambda _m: None) is ddp)
    rep.check("requires_grad_ returns the wrapper", ddp.requires_grad_(True) is ddp)
    for move in (lambda: ddp.to(torch.float32), lambda: ddp.double()):
        try:
            move()
            rep.check("moving after wrapping is refused", False)
        except RuntimeError as e:
            rep.check("moving after wrapping is refused", "before wrapping" in str(e), str(e))
    rep.check("nn.Module's stores are the module's", ddp._modules is model._modules)
    model._pp_private = 1
    rep.check("the module's private attributes are not passed on", not hasattr(ddp, "_pp_private"))
    rep.check("a missing attribute is an AttributeError", not hasattr(ddp, "no_such_attribute"))
    ids = _micro(9, 0, world.rank)["input_ids"][:, :3]
    with torch.no_grad():
        got = ddp.generate(ids, max_new_tokens=3, do_sample=False)
        want = ref.generate(ids, max_new_tokens=3, do_sample=False)
    rep.check("generate through the wrapper", torch.equal(got, want), f"{got.tolist()} vs {want.tolist()}")
    saved = theirs.state_dict()  # torch DDP's keys: "module."-prefixed
    fresh = pp.DDP(tm.build("gpt2", seed=5), world.group)
    fresh.load_state_dict(saved)
    rep.equal("a torch DDP state loads", tm.flat_params(fresh.module), tm.flat_params(theirs.module), rtol=0)
    rep.digests["ddp"] = digest(tm.flat_params(model))


def fsdp_loop(world: Any, rep: Report) -> None:
    import torch

    n = world.world_size
    model = tm.build("gpt2", seed=0)
    fsdp = pp.FSDP(model, world.group, "full_shard")
    ref = tm.build("gpt2", seed=0)
    b = _micro(0, 0, world.rank)

    # before any fsdp(...) call: the module called directly gathers its units (NaN logits before)
    with torch.no_grad():
        got, want = model(**b).logits, ref(**b).logits
    rep.equal("module called directly", got.numpy(), want.numpy(), rtol=1e-12)
    ids = b["input_ids"][:, :3]
    with torch.no_grad():
        got = fsdp.generate(ids, max_new_tokens=3, do_sample=False)
        want = ref.generate(ids, max_new_tokens=3, do_sample=False)
    rep.check("generate through the wrapper", torch.equal(got, want), f"{got.tolist()} vs {want.tolist()}")

    rep.check("parameters() is an iterator, as torch's", next(fsdp.parameters()).ndim == 1)  # a flat shard
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):  # FSDP2's accumulation recipe, word for word
        for micro in range(MICRO):
            last = micro == MICRO - 1
            fsdp.set_requires_gradient_sync(last)
            fsdp.set_reshard_after_backward(last)
            fsdp.set_is_last_backward(last)
            (fsdp(**_micro(step, micro, world.rank)).loss / MICRO).backward()
        fsdp.clip_grad_norm_(1e9)  # the global norm: a collective every rank joins
        opt.step()
        opt.zero_grad(set_to_none=True)
        _reference_step(ref, ref_opt, step, n)
    with fsdp.summon_full_params():
        rep.close("accumulation equals one process", tm.flat_params(model), tm.flat_params(ref), 1e-9)
    _fsdp2_setters(world, rep, fsdp, b)
    _save_pretrained(world, rep, fsdp)

    # after a step the units are resharded: their modules refuse to run alone, the state dict to hold NaNs
    x = torch.zeros(1, 2, model.config.n_embd, dtype=torch.float64)
    rep.raises(
        "a sharded block's layer called alone",
        RuntimeError,
        lambda: model.transformer.h[0].attn.c_attn(x),
        "sharded",
    )
    rep.raises("the tied embedding called alone", RuntimeError, lambda: model.transformer.wte(ids), "sharded")
    rep.raises("module.state_dict() while sharded", RuntimeError, model.state_dict, "fsdp.state_dict()")
    rep.raises(
        "a submodule's state_dict() while sharded",
        RuntimeError,
        model.transformer.h[1].state_dict,
        "fsdp.state_dict()",
    )
    rep.raises(
        "module.load_state_dict() while sharded",
        RuntimeError,
        lambda: model.load_state_dict(ref.state_dict()),
        "fsdp.load_state_dict",
    )
    keys = list(model.state_dict(keep_vars=True))
    rep.check("keep_vars=True (keys) still answers", keys == list(ref.state_dict()))
    full = fsdp.state_dict()
    with fsdp.summon_full_params():
        model.load_state_dict(full)  # inside: writes go to the full parameters and are kept (the same values)
        inside = model.state_dict()
        rep.check("state_dict() inside summon_full_params", list(inside) == list(full) and all(
            torch.equal(inside[k], full[k]) for k in full))  # fmt: skip
        if world.rank == 0:  # one rank alone: no collective inside
            with torch.no_grad():
                got = fsdp.generate(ids, max_new_tokens=3, do_sample=False)
                want = ref.generate(ids, max_new_tokens=3, do_sample=False)
            rep.check("rank 0 alone samples inside summon_full_params", torch.equal(got, want))
        rep.raises(
            "a grad-enabled forward inside summon_full_params", RuntimeError, lambda: fsdp(**b), "no_grad"
        )
    world.group.barrier()
    loss = fsdp(**_micro(5, 0, world.rank)).loss
    loss.backward()
    ref_loss = ref(**_micro(5, 0, world.rank)).loss
    rep.equal(
        "a forward after summon_full_params", loss.detach().numpy(), ref_loss.detach().numpy(), rtol=1e-9
    )
    opt.zero_grad(set_to_none=True)
    rep.digests["fsdp"] = digest(fsdp.state_dict()["lm_head.weight"].numpy())

    # mixed precision casts keyword inputs too (float32 inputs_embeds met bfloat16 layers and raised before)
    half = tm.build("gpt2", seed=0, dtype=torch.float32)
    plain = tm.build("gpt2", seed=0, dtype=torch.float32)
    mp = pp.FSDP(half, world.group, mixed_precision=pp.MixedPrecision(param_dtype="bfloat16"))
    embeds = torch.from_numpy(np.random.default_rng(world.rank).standard_normal((2, tm.SEQ, 16), np.float32))
    kw = {"inputs_embeds": embeds, "labels": b["input_ids"]}
    got = float(mp(**kw).loss)
    with torch.no_grad():
        want = float(plain(**kw).loss)
    rep.check(
        "bfloat16 compute from float32 keyword inputs", abs(got - want) <= 3e-2 * abs(want), f"{got} {want}"
    )

    # An optimizer over the module's own parameters (built before wrapping, as a DDP script does, or from
    # fsdp.module after it) never sees a gradient: its step raises instead of silently changing nothing.
    early = tm.build("gpt2", seed=0)
    early_opt = torch.optim.AdamW(early.parameters(), lr=1e-2)
    wrapped = pp.FSDP(early, world.group)
    late_opt = torch.optim.SGD(list(wrapped.module.parameters())[-1:], lr=1e-2)
    wrapped(**b).loss.backward()
    rep.raises("an optimizer built before wrapping", RuntimeError, early_opt.step, "fsdp.parameters()")
    rep.raises("an optimizer over fsdp.module's parameters", RuntimeError, late_opt.step, "fsdp.parameters()")
    good = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in wrapped.parameters()]
    good.step()
    rep.check(
        "the wrapper's optimizer steps",
        all(not torch.equal(a, p) for a, p in zip(before, wrapped.parameters())),
    )

    # strict=False, as torch's (a pretrained backbone into a model with a new head): the keys given load, the
    # others stay, and the keys skipped are torch's; strict=True names them in a ValueError
    plain = tm.build("gpt2", seed=0)
    plain.load_state_dict(fsdp.state_dict())
    partial = {k: v for k, v in tm.build("gpt2", seed=3).state_dict().items() if ".h.1." not in k}
    partial["head.extra"] = torch.zeros(2, dtype=torch.float64)
    got, want = fsdp.load_state_dict(partial, strict=False), plain.load_state_dict(partial, strict=False)
    rep.check("strict=False: the keys skipped, as torch's", (sorted(got.missing_keys), got.unexpected_keys) == (
        sorted(want.missing_keys), want.unexpected_keys), f"{got} vs {want}")  # fmt: skip
    after, plain_state = fsdp.state_dict(), plain.state_dict()
    rep.check(
        "strict=False: the state equals torch's",
        all(torch.equal(after[k], plain_state[k]) for k in plain_state),
    )
    rep.raises(
        "strict=True refuses a partial state", ValueError, lambda: fsdp.load_state_dict(partial), "head.extra"
    )

    # torch FSDP1's call shape: writeback=False drops the writes; rank0_only (with it) gives the parameters
    before = fsdp.state_dict()
    with pp.FSDP.summon_full_params(fsdp, writeback=False, rank0_only=True), torch.no_grad():
        model.lm_head.weight.zero_()  # tied to the embedding: both
        zeroed = bool((model.transformer.wte.weight == 0).all())
    after = fsdp.state_dict()
    rep.check(
        "writeback=False: the writes are dropped",
        zeroed and all(torch.equal(before[k], after[k]) for k in before),
    )
    try:
        with fsdp.summon_full_params(rank0_only=True):
            pass
        rep.check("rank0_only with writeback is refused", False, "no error")
    except ValueError as e:
        rep.check("rank0_only with writeback is refused", "writeback=False" in str(e), str(e))

    # torch FSDP1's state_dict_type around state_dict(): FULL_STATE_DICT is the full state; sharded types refused
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with pp.FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, config):
        full_state = fsdp.state_dict()
    rep.check("FULL_STATE_DICT: the full state", all(torch.equal(full_state[k], after[k]) for k in after))
    try:
        with pp.FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            pass
        rep.check("SHARDED_STATE_DICT is refused", False, "no error")
    except ValueError as e:
        rep.check("SHARDED_STATE_DICT is refused", "sharded_state_dict()" in str(e), str(e))


def _train_more(name: str, wrapped: Any, rank: int | None, num_ranks: int, clip: Any) -> None:
    """3 AdamW steps with clipping on this rank's batches (``num_ranks`` = 1 with ``rank`` None: the whole batch)."""
    import torch

    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for step in range(3):
        parts = [tm.more_batch(name, step, r) for r in (range(num_ranks) if rank is None else [rank])]
        wrapped(**{k: torch.cat([p[k] for p in parts]) for k in parts[0]}).loss.backward()
        clip(0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _values(state: dict[str, Any]) -> np.ndarray:
    return np.concatenate([v.double().reshape(-1).numpy() for v in state.values()])


def more_models(world: Any, rep: Report) -> None:
    """``tm.MORE_MODELS`` under pp.DDP and pp.FSDP (full_shard, default units) with clipping: every parameter
    and buffer equals one process on the whole batch after 3 AdamW steps, and pp.DDP's equal torch's DDP (gloo)
    in the same loop."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    tm.init_gloo(world)
    n, rank = world.world_size, world.rank
    clip_params = lambda m: lambda c: torch.nn.utils.clip_grad_norm_(m.parameters(), c)  # noqa: E731
    for name in tm.MORE_MODELS:
        ref = tm.build_more(name)
        _train_more(name, ref, None, n, clip_params(ref))
        want = ref.state_dict()
        rtol = 1e-4 if name == "mixtral" else 1e-9  # float32 (Mixtral: no float64 expert kernel)
        theirs = tm.build_more(name)
        _train_more(name, DistributedDataParallel(theirs), rank, n, clip_params(theirs))
        for how in ("ddp", "full_shard"):
            model = tm.build_more(name)
            if how == "ddp":
                wrapped: Any = pp.DDP(model, world.group)
                _train_more(name, wrapped, rank, n, clip_params(wrapped))
                state = model.state_dict()
                rep.close(f"{name}: pp.DDP = torch's DDP", _values(state), _values(theirs.state_dict()),
                          1e-6 if name == "mixtral" else 1e-12)  # fmt: skip
            else:
                wrapped = pp.FSDP(model, world.group, how)
                _train_more(name, wrapped, rank, n, wrapped.clip_grad_norm_)
                state = wrapped.state_dict()
                # ALBERT: its one shared layer group and the root
                rep.check(
                    f"{name}: one unit per block and the root",
                    len(wrapped.units) == 2 if name == "albert" else len(wrapped.units) > 2,
                    str(len(wrapped.units)),
                )
            rep.check(f"{name} {how}: keys", list(state) == list(want))
            rep.close(f"{name} {how}: state = one process", _values(state),
                      np.concatenate([want[k].double().reshape(-1).numpy() for k in state]), rtol)  # fmt: skip
            rep.digests[f"{name}/{how}"] = digest(_values(state))


def compiled(world: Any, rep: Report) -> None:
    """``torch.compile(model)`` (the aot_eager backend: torch's graph capture and AOT autograd without a C++
    toolchain) under pp.DDP and pp.FSDP: parameters equal one process after 3 AdamW steps, and the wrapper's
    state dict has the compiled module's keys (``_orig_mod.`` first, as torch's). And ``torch.compile(ddp)``, the
    order torch's DDP documents (pp.DDP is an nn.Module): the same, and equal to torch's DDP (gloo) compiled so."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    n, rank = world.world_size, world.rank

    def train(model: Any, batch: Any) -> Any:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            model(**batch(step)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model.state_dict()

    want = train(tm.build("gpt2", seed=0), lambda step: tm.global_batch("gpt2", step, n))
    flat_want = np.concatenate([v.double().reshape(-1).numpy() for v in want.values()])
    for how in ("ddp", "full_shard", "compile(ddp)"):
        if how == "compile(ddp)":
            wrapped = torch.compile(pp.DDP(tm.build("gpt2", seed=0), world.group), backend="aot_eager")
        else:
            model = torch.compile(tm.build("gpt2", seed=0), backend="aot_eager")
            wrapped = pp.DDP(model, world.group) if how == "ddp" else pp.FSDP(model, world.group, how)
        state = train(wrapped, lambda step: tm.batch("gpt2", step, rank))
        rep.check(f"{how}: the compiled module's keys", list(state) == [f"_orig_mod.{k}" for k in want])
        got = np.concatenate([v.double().reshape(-1).numpy() for v in state.values()])
        rep.close(f"{how}: compiled = one process", got, flat_want, 1e-9)
        rep.digests[how] = digest(got)
    tm.init_gloo(world)
    theirs = torch.compile(DistributedDataParallel(tm.build("gpt2", seed=0)), backend="aot_eager")
    state = train(theirs, lambda step: tm.batch("gpt2", step, rank))
    rep.close("compile(ddp) = torch's compiled DDP", got,
              np.concatenate([v.double().reshape(-1).numpy() for v in state.values()]), 1e-12)  # fmt: skip


if __name__ == "__main__":
    run_rank({"ddp": ddp_loop, "fsdp": fsdp_loop, "more": more_models, "compiled": compiled}[sys.argv[1]])
