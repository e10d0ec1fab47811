"""What pp.DDP and pp.FSDP refuse about the module's parameters, on torch's and transformers' modules (world 2).

- A parameter frozen at wrap time and unfrozen later (a fine-tuning loop unfreezing its embeddings after a
  few epochs) gets a gradient neither wrapper synchronises, as torch's: the ranks' copies would part
  silently. The backward that gives it a gradient now raises a RuntimeError naming it. Freezing after
  wrapping, the direction that works, trains as one process with the parameter frozen from the start.
- A lazy module's uninitialised parameters and ``sparse=True`` embeddings are ValueErrors at wrap time.
- torch's compression hooks (``register_comm_hook(None, fp16_compress_hook)``) compress pp.DDP's all-reduce as
  torch's DDP does with them; other hooks are a NotImplementedError.
"""

from __future__ import annotations

import copy
import functools
import io
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp

WRAPPERS = {"ddp": lambda m, g: pp.DDP(m, g), "fsdp": lambda m, g: pp.FSDP(m, g, "full_shard")}


def scenario(world: Any, rep: Report) -> None:
    for kind, wrap in WRAPPERS.items():
        _checks(world, rep, kind, wrap)
    _comm_hooks(world, rep)
    _wrapped_twice(world, rep)
    total = world.group.all_reduce(np.array([1.0]))
    rep.check("the world is intact", float(total[0]) == world.world_size, str(total))


def _checks(world: Any, rep: Report, kind: str, wrap: Any) -> None:
    import torch

    n = world.world_size
    # unfrozen after wrapping: refused at the backward that gives it a gradient
    model = tm.build("gpt2", seed=0)
    model.transformer.wpe.weight.requires_grad_(False)
    wrapped = wrap(model, world.group)
    model.transformer.wpe.weight.requires_grad_(True)
    b = tm.batch("gpt2", 0, world.rank)
    rep.raises(
        f"{kind}: unfrozen after wrapping",
        RuntimeError,
        lambda: wrapped(**b).loss.backward(),
        "'transformer.wpe.weight' did not require grad when the module was wrapped",
    )

    # frozen after wrapping: taken as unused; 2 SGD steps equal one process with it frozen from the start
    model = tm.build("gpt2", seed=0)
    ref = tm.build("gpt2", seed=0)
    wrapped = wrap(model, world.group)
    model.transformer.wpe.weight.requires_grad_(False)
    ref.transformer.wpe.weight.requires_grad_(False)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        wrapped(**tm.batch("gpt2", step, world.rank)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sum(ref(**tm.batch("gpt2", step, r)).loss / n for r in range(n)).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    if kind == "fsdp":
        with wrapped.summon_full_params():
            got = tm.flat_params(model)
    else:
        got = tm.flat_params(model)
    rep.close(f"{kind}: frozen after wrapping trains as one process", got, tm.flat_params(ref), 1e-9)

    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 1))
    rep.raises(f"{kind}: a lazy module", ValueError, lambda: wrap(lazy, world.group), "forward pass")
    # without use_orig_params frozen parameters stay whole on every rank: a wholly frozen model has nothing to shard
    if kind == "fsdp":
        teacher = tm.build("gpt2", seed=0).requires_grad_(False)
        rep.raises("fsdp: a frozen model", ValueError, lambda: wrap(teacher, world.group), "unwrapped")
    bag = torch.nn.Sequential(torch.nn.EmbeddingBag(20, 4, sparse=True), torch.nn.Linear(4, 1))
    rep.raises(f"{kind}: sparse gradients", ValueError, lambda: wrap(bag, world.group), "sparse=False")


def _grads(wrapped: Any, rank: int) -> np.ndarray:
    wrapped(**tm.batch("gpt2", 0, rank)).loss.backward()
    return tm.flat_grads(wrapped.module)


def _comm_hooks(world: Any, rep: Report) -> None:
    """torch's compression hooks through ``register_comm_hook``: fp16's averaged gradients equal torch's DDP with
    the same hook (gloo) to float16's precision (torch's bf16 hook needs NCCL: bf16's equal the uncompressed mean
    to bfloat16's), and both differ from uncompressed ones."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    tm.init_gloo(world)
    plain = _grads(pp.DDP(tm.build("gpt2", seed=0, dtype=torch.float32), world.group), world.rank)
    for hook in (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook):
        ours = pp.DDP(tm.build("gpt2", seed=0, dtype=torch.float32), world.group)
        ours.register_comm_hook(None, hook)
        got = _grads(ours, world.rank)
        if hook is default_hooks.fp16_compress_hook:
            theirs = DistributedDataParallel(tm.build("gpt2", seed=0, dtype=torch.float32))
            theirs.register_comm_hook(None, hook)
            rep.close("fp16_compress_hook: torch's DDP with the hook", got, _grads(theirs, world.rank), 2e-3)
        else:  # torch's bf16 hook runs on NCCL only: against the uncompressed mean, to bfloat16's precision
            rep.close("bf16_compress_hook: the mean to bfloat16's precision", got, plain, 2e-2)
        rep.check(f"{hook.__name__}: compressed on the wire", not np.array_equal(got, plain))
        rep.raises(
            f"{hook.__name__}: registered twice",
            RuntimeError,
            functools.partial(ours.register_comm_hook, None, hook),
            "once",
        )
    other = pp.DDP(tm.build("gpt2", seed=0), world.group)
    rep.raises(
        "another hook",
        NotImplementedError,
        lambda: other.register_comm_hook(None, default_hooks.allreduce_hook),
        "fp16_compress_hook",
    )


def _wrapped_twice(world: Any, rep: Report) -> None:
    """``DDP(ddp.module)`` takes over: the older wrapper's hooks are gone (a ``no_sync`` backward of the newer
    stays local, which the older's hooks would have averaged) and the older refuses to run. FSDP2's habit of
    ``fully_shard`` per block then on the root, and any wrapper over a pp.FSDP's module, are ValueErrors (the
    second wrapper used to read and broadcast the first's placeholders)."""
    import torch

    model = tm.build("gpt2", seed=0)
    old = pp.DDP(model, world.group)
    new = pp.DDP(old.module, world.group)
    with new.no_sync():
        new(**tm.batch("gpt2", 0, world.rank)).loss.backward()
    grads = world.group.all_gather(tm.flat_grads(model)[None])
    rep.check("DDP(ddp.module): the older wrapper's hooks are removed", not np.allclose(grads[0], grads[1]))
    rep.raises(
        "DDP(ddp.module): the older wrapper refuses to run",
        RuntimeError,
        lambda: old(**tm.batch("gpt2", 0, 0)),
        "superseded",
    )
    model.zero_grad(set_to_none=True)
    n = world.world_size
    ref = tm.build("gpt2", seed=0)
    opt, ref_opt = torch.optim.SGD(new.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    new(**tm.batch("gpt2", 1, world.rank)).loss.backward()
    opt.step()
    sum(ref(**tm.batch("gpt2", 1, r)).loss / n for r in range(n)).backward()
    ref_opt.step()
    rep.close("DDP(ddp.module) trains as one process", tm.flat_params(model), tm.flat_params(ref), 1e-9)
    # what marks the wrapped parameters stays off them: the module still pickles whole (torch.save(model)), and a
    # deepcopy of it (a teacher copied from the student) is a module of its own that wraps without taking over
    buffer = io.BytesIO()
    torch.save(new.module, buffer)
    rep.check("torch.save of a wrapped module", buffer.tell() > 0)
    teacher = pp.DDP(copy.deepcopy(new.module), world.group)
    rep.check("a deepcopy wraps on its own", not new._superseded and teacher.module is not new.module)

    nested = tm.build("gpt2", seed=0)
    for block in nested.transformer.h:
        pp.FSDP(block, world.group)
    rep.raises(
        "FSDP per block, then at the root",
        ValueError,
        lambda: pp.FSDP(nested, world.group),
        "wrap the model once",
    )
    rep.raises(
        "DDP over a pp.FSDP's module",
        ValueError,
        lambda: pp.DDP(nested, world.group),
        "already wrapped by a pp.FSDP",
    )


if __name__ == "__main__":
    run_rank(scenario)
