"""A script's own ``torch.distributed`` calls over ``pp.init_torch_distributed(world)`` (world 2 or 3).

Every collective a training script or library calls through ``dist.*`` gives, on every rank, what the ranks'
known inputs make (computed here from all of them: a reduction over other ranks' values, not this rank's own),
synchronously and with ``async_op``; ``*_object`` calls, ``dist.new_group`` (a non-member gets no group), the
default store across ranks; torch's own ``DistributedDataParallel`` and FSDP2 (``fully_shard``, its DeviceMesh
over the default group) over the backend train transformers' GPT-2 equal to one process on the whole batch
(float64, 1e-9); torch's tensor parallel (``parallelize_module``) and DTensor redistributions (functional
collectives, issued from C++) and torch's pipelining (GPipe, 1F1B) give the plain module's values; a
``torch.distributed.checkpoint`` save of the FSDP2 model loads back into a fresh one. Bad input is a clear error, before anything is
sent: a tag, all_to_all split sizes that do not add up, an unsupported reduction, shapes that disagree across ranks (CollectiveMismatch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp

STEPS = 3


def _value(rank: int) -> Any:
    import torch

    return torch.tensor([rank + 1.0, 2.0 * rank - 1.0, 0.5 + rank], dtype=torch.float64)


def _collectives(world: Any, rep: Report) -> None:
    import torch
    import torch.distributed as dist

    r, n = world.rank, world.world_size
    every = [_value(i) for i in range(n)]
    want = {
        "SUM": sum(every),
        "AVG": sum(every) / n,
        "MIN": torch.stack(every).min(0).values,
        "MAX": torch.stack(every).max(0).values,
        "PRODUCT": torch.stack(every).prod(0),
    }
    for name, expected in want.items():
        t = _value(r)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        rep.check(f"all_reduce {name}", torch.allclose(t, expected, rtol=1e-12), f"{t} vs {expected}")
    t = _value(r)
    work = dist.all_reduce(t, async_op=True)
    got = work.get_future().wait()
    rep.check(
        "async all_reduce: wait() and the future's value",
        work.wait() and torch.equal(t, want["SUM"]) and torch.equal(got[0], want["SUM"]),
        f"{t}",
    )
    w = _value(r).requires_grad_()
    loss = (w * 2).sum()  # a loss reduced for logging, as gloo allows: in place, autograd untouched
    dist.all_reduce(loss)
    rep.check("all_reduce of a tensor that requires grad", float(loss) == float(want["SUM"].sum() * 2), "")
    for dtype in (torch.bfloat16, torch.int64):
        t = torch.full((4,), r + 1, dtype=dtype)
        dist.all_reduce(t)
        rep.check(f"all_reduce {dtype}", bool((t == n * (n + 1) // 2).all()), f"{t}")
    pair = [_value(r), _value(r)[:2] * 3]
    dist.all_reduce_coalesced(pair)
    rep.check(
        "all_reduce_coalesced",
        torch.equal(pair[0], want["SUM"]) and torch.equal(pair[1], want["SUM"][:2] * 3),
        f"{pair}",
    )
    outs = [torch.empty(3, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(outs, _value(r))
    rep.check("all_gather", all(torch.equal(o, e) for o, e in zip(outs, every)), f"{outs}")
    flat = torch.empty(3 * n, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, _value(r))
    rep.check("all_gather_into_tensor", torch.equal(flat, torch.cat(every)), f"{flat}")
    pieces = [_value(r) * (i + 1) for i in range(n)]  # rank r sends pieces[i] to rank i
    out = torch.empty(3, dtype=torch.float64)
    dist.reduce_scatter(out, pieces)
    rep.check("reduce_scatter", torch.allclose(out, want["SUM"] * (r + 1), rtol=1e-12), f"{out}")
    out = torch.empty(3, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, torch.cat(pieces))
    rep.check("reduce_scatter_tensor", torch.allclose(out, want["SUM"] * (r + 1), rtol=1e-12), f"{out}")
    t = _value(r)
    dist.broadcast(t, src=n - 1)
    rep.check("broadcast from the last rank", torch.equal(t, every[-1]), f"{t}")
    gathered = [torch.empty(3, dtype=torch.float64) for _ in range(n)] if r == 0 else None
    dist.gather(_value(r), gathered, dst=0)
    rep.check("gather to rank 0", r != 0 or all(torch.equal(g, e) for g, e in zip(gathered or [], every)))
    out = torch.empty(3, dtype=torch.float64)
    dist.scatter(out, [_value(i) * 10 for i in range(n)] if r == 0 else None, src=0)
    rep.check("scatter from rank 0", torch.equal(out, every[r] * 10), f"{out}")
    # all_to_all: rank r sends block i (its value times i + 1) to rank i, so rank r receives every rank's r + 1 block
    blocks = torch.cat([_value(r) * (i + 1) for i in range(n)])
    out = torch.empty_like(blocks)
    dist.all_to_all_single(out, blocks)
    rep.check("all_to_all_single", torch.equal(out, torch.cat([e * (r + 1) for e in every])), f"{out}")
    out = torch.empty_like(blocks)
    dist.all_to_all_single(out, blocks, [3] * n, [3] * n, async_op=True).wait()
    rep.check(
        "async all_to_all_single with equal split sizes",
        torch.equal(out, torch.cat([e * (r + 1) for e in every])),
    )
    outs = [torch.empty(3, dtype=torch.float64) for _ in range(n)]
    dist.all_to_all(outs, [_value(r) - i for i in range(n)])
    rep.check("all_to_all", all(torch.equal(o, e - r) for o, e in zip(outs, every)), f"{outs}")
    # uneven, as a mixture of experts routes tokens: rank r sends i + 1 rows of [r, i] to rank i
    ins = torch.cat([torch.tensor([[float(r), float(i)]] * (i + 1)) for i in range(n)])
    out = torch.empty(n * (r + 1), 2)
    dist.all_to_all_single(out, ins, [r + 1] * n, [i + 1 for i in range(n)])
    want_rows = torch.cat([torch.tensor([[float(j), float(r)]] * (r + 1)) for j in range(n)])
    rep.check("all_to_all_single with split sizes", torch.equal(out, want_rows), f"{out}")
    outs = [torch.empty(j + 1, 2) for j in range(n)]  # from rank j: j + 1 rows
    dist.all_to_all(outs, [torch.full((r + 1, 2), 10.0 * r + i) for i in range(n)])
    rep.check(
        "all_to_all of tensors of different shapes",
        all(torch.equal(o, torch.full((j + 1, 2), 10.0 * j + r)) for j, o in enumerate(outs)),
        f"{outs}",
    )
    t = _value(r)
    dist.reduce(t, dst=0)
    rep.check("reduce to rank 0", r != 0 or torch.equal(t, want["SUM"]), f"{t}")
    # a ring of point-to-point messages, blocking one way and async the other
    nxt, prv = (r + 1) % n, (r - 1) % n
    got_p2p = torch.empty(3, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, _value(r), nxt), dist.P2POp(dist.irecv, got_p2p, prv)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    rep.check("batch_isend_irecv around a ring", torch.equal(got_p2p, every[prv]), f"{got_p2p}")
    if r == 0:
        dist.send(_value(0) * 7, dst=1)
    elif r == 1:
        t = torch.empty(3, dtype=torch.float64)
        dist.recv(t, src=0)
        rep.check("send / recv", torch.equal(t, every[0] * 7), f"{t}")

    objs: list[Any] = [{"config": "from rank 0", "lr": 0.1}] if r == 0 else [None]
    dist.broadcast_object_list(objs, src=0)
    rep.check("broadcast_object_list", objs == [{"config": "from rank 0", "lr": 0.1}], f"{objs}")
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, {"rank": r})
    rep.check("all_gather_object", everyone == [{"rank": i} for i in range(n)], f"{everyone}")

    sub = dist.new_group([0, 1])
    if r in (0, 1):
        t = _value(r)
        dist.all_reduce(t, group=sub)
        rep.check("a new_group's all_reduce", torch.equal(t, every[0] + every[1]), f"{t}")
        rep.check("the subgroup's size", dist.get_world_size(sub) == 2, "")
    else:
        rep.check("a non-member gets no group", sub == dist.GroupMember.NON_GROUP_MEMBER, f"{sub}")

    store = dist.distributed_c10d._get_default_store()
    if r == 0:
        store.set("config", "set by rank 0")
    rep.check("the store: a get waits for another rank's set", store.get("config") == b"set by rank 0")
    store.add("arrived", 1)
    dist.barrier()
    rep.check("the store: add counts every rank", store.add("arrived", 0) == n, "")


def _train(model: Any, opt: Any, rank: int | None, n: int) -> list[float]:
    """``STEPS`` steps of the usual loop (rank None: one process on every rank's batch); this rank's losses."""
    losses = []
    for step in range(STEPS):
        parts = [rank] if rank is not None else list(range(n))
        loss = sum(tm.loss64(model, tm.batch("gpt2", step, p)) for p in parts) / len(parts)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _pp_wrappers(world: Any, rep: Report) -> None:
    """pp.DDP / pp.FSDP take torch's groups of the backend: none (the default group) or ``process_group=``."""
    import torch.distributed as dist

    ddp = pp.DDP(tm.build("gpt2"))
    rep.check(
        "pp.DDP without a group runs over torch's default group", ddp.group is world.group, f"{ddp.group}"
    )
    sub = dist.new_group(list(range(world.world_size)))
    fsdp = pp.FSDP(tm.build("gpt2"), process_group=sub)
    rep.check("pp.FSDP(process_group=a torch group of the backend)", fsdp.group is sub.plane_group, "")
    loss = tm.loss64(fsdp, tm.batch("gpt2", 0, world.rank))
    loss.backward()
    rep.check("and trains a step", all(p.grad is not None for p in fsdp.parameters()), "")
    scaler = pp.ShardedGradScaler("cpu")
    rep.check(
        "pp.ShardedGradScaler without a group: torch's default group", scaler.process_group is world.group, ""
    )
    scaler = pp.ShardedGradScaler("cpu", process_group=sub)
    rep.check(
        "pp.ShardedGradScaler(process_group=a torch group of the backend)",
        scaler.process_group is sub.plane_group,
        "",
    )


def _torch_ddp(world: Any, rep: Report) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    n = world.world_size
    ref = tm.build("gpt2")
    want = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), None, n)
    model = tm.build("gpt2", seed=world.rank)  # DDP's wrap broadcasts rank 0's weights
    ddp = DistributedDataParallel(model)
    local = np.array(_train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), world.rank, n))
    world.group.all_reduce(local)
    got = local / n
    rep.check("torch's DDP over the backend: losses = one process", bool(np.allclose(got, want, rtol=1e-9)))
    state, ref_state = model.state_dict(), ref.state_dict()
    bad = [k for k in ref_state if not torch.allclose(state[k], ref_state[k], rtol=1e-9, atol=1e-12)]
    rep.check("torch's DDP over the backend: parameters = one process", not bad, f"{bad[:3]}")


def _torch_fsdp2(world: Any, rep: Report) -> None:
    """torch's FSDP2 (``fully_shard`` per block, then the root; a DeviceMesh over the default group) over the
    backend, with clipping: losses and gradient norms = one process."""
    import torch
    from torch.distributed.fsdp import fully_shard

    n = world.world_size
    ref = tm.build("gpt2")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = tm.build("gpt2")
    for block in [m for m in model.modules() if isinstance(m, tm.block_class(model))]:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    got, want = [], []
    for step in range(STEPS):
        loss = tm.loss64(model, tm.batch("gpt2", step, world.rank))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        opt.step()
        opt.zero_grad()
        ref_loss = sum(tm.loss64(ref, tm.batch("gpt2", step, r)) for r in range(n)) / n
        ref_loss.backward()
        want.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        ref_opt.step()
        ref_opt.zero_grad()
        got.append(float(norm))
        total = np.array([float(loss.detach())])
        world.group.all_reduce(total)
        want.append(float(ref_loss.detach()))
        got.append(float(total[0]) / n)
    rep.check(
        "torch's FSDP2 over the backend: norms and losses = one process",
        bool(np.allclose(got, want, rtol=1e-9)),
        f"{got} vs {want}",
    )
    # torch.distributed.checkpoint (its planning gathers and broadcasts objects): a sharded save of the trained
    # model and optimizer, loaded into a fresh FSDP2 model, gives back the same full state
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = str(Path(os.environ["PARAMPLANE_TEST_OUT"]) / f"dcp-{n}")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fresh = tm.build("gpt2")
    for block in [m for m in fresh.modules() if isinstance(m, tm.block_class(fresh))]:
        fully_shard(block)
    fully_shard(fresh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_opt), strict=True))
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = get_state_dict(fresh, fresh_opt)[0]
    rep.check(
        "torch.distributed.checkpoint over the backend: save, load into a fresh FSDP2 model, same full state",
        all(torch.equal(v.full_tensor(), loaded[k].full_tensor()) for k, v in model_sd.items()),
    )


def _torch_tensor_parallel(world: Any, rep: Report) -> None:
    """torch's own tensor parallel (``parallelize_module``) and DTensor redistributions, whose functional
    collectives torch issues from C++, over the backend."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    r, n = world.rank, world.world_size
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 6 * n), torch.nn.ReLU(), torch.nn.Linear(6 * n, 8)).double()
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 6 * n), torch.nn.ReLU(), torch.nn.Linear(6 * n, 8)
    ).double()
    model.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (n,))
    tp = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    y, want = tp(x), ref(x)
    y.square().sum().backward()
    want.square().sum().backward()
    rep.check(
        "torch's parallelize_module over the backend: the output = the plain module's",
        torch.allclose(y, want, rtol=1e-12),
    )
    full = [p.grad.full_tensor() for p in tp.parameters()]  # all-gathers through the functional collectives
    rep.check(
        "and every gradient (full_tensor) = the plain module's",
        all(torch.allclose(g, p.grad, rtol=1e-12) for g, p in zip(full, ref.parameters())),
    )
    local = torch.arange(2.0 * n, dtype=torch.float64) * (r + 1)
    shard = DTensor.from_local(local, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local()
    total = torch.arange(2.0 * n, dtype=torch.float64) * (n * (n + 1) // 2)
    rep.check(
        "DTensor Partial -> Shard (a reduce-scatter)",
        torch.equal(shard, total[2 * r : 2 * r + 2]),
        f"{shard}",
    )
    whole = DTensor.from_local(local[:2], mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
    rep.check(
        "DTensor Shard -> Replicate (an all-gather)",
        torch.equal(whole, torch.cat([torch.arange(2.0, dtype=torch.float64) * (i + 1) for i in range(n)])),
        f"{whole}",
    )
    matrix = torch.arange(4.0 * n * n, dtype=torch.float64).view(2 * n, 2 * n)
    columns = DTensor.from_local(matrix[2 * r : 2 * r + 2], mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])
    rep.check(
        "DTensor Shard(0) -> Shard(1) (an all-to-all)",
        torch.equal(columns.to_local(), matrix[:, 2 * r : 2 * r + 2]),
        f"{columns.to_local()}",
    )


def _torch_pipelining(world: Any, rep: Report) -> None:
    """torch's own ``torch.distributed.pipelining`` (GPipe, 1F1B) over the backend: one stage per rank, the
    losses and each stage's gradients equal the plain model's on the whole batch."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    r, n = world.rank, world.world_size
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)]).double()
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)]).double()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    target = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def loss_fn(y: Any, t: Any) -> Any:
        return (y - t).square().sum()

    want = loss_fn(ref(x), target)
    want.backward()
    stage = PipelineStage(model[r], r, n, torch.device("cpu"))
    for schedule in (ScheduleGPipe, Schedule1F1B):
        model.zero_grad(set_to_none=True)
        run = schedule(stage, n_microbatches=4, loss_fn=loss_fn)
        losses: list[Any] = []
        if r == 0:
            run.step(x)
        elif r == n - 1:
            run.step(target=target, losses=losses)
        else:
            run.step()
        if r == n - 1:
            got = float(sum(loss.detach() for loss in losses))
            rep.check(
                f"torch's {schedule.__name__} over the backend: the loss",
                abs(got - float(want)) < 1e-9 * abs(float(want)),
                f"{got} vs {float(want)}",
            )
        rep.check(
            f"torch's {schedule.__name__}: this stage's gradients",
            all(
                torch.allclose(p.grad, q.grad / 4, rtol=1e-9)  # torch scales by 1 / microbatches
                for p, q in zip(model[r].parameters(), ref[r].parameters())
            ),
        )


def _errors(world: Any, rep: Report) -> None:
    import torch
    import torch.distributed as dist

    r = world.rank
    rep.raises(
        "a tag", ValueError, lambda: dist.send(torch.ones(1), dst=(r + 1) % 2, tag=3), "tag=3", "in order"
    )
    rep.raises(
        "an unsupported reduction",
        ValueError,
        lambda: dist.all_reduce(torch.ones(1, dtype=torch.int64), op=dist.ReduceOp.BAND),
        "BAND",
    )
    n = world.world_size
    rep.raises(
        "all_to_all_single with split sizes that do not sum to the input",
        ValueError,
        lambda: dist.all_to_all_single(torch.empty(n + 1), torch.ones(n + 1), [1] * n, [1] * n),
        "sum to",
    )
    rep.raises(
        "all_to_all_single of a length the ranks do not divide",
        ValueError,
        lambda: dist.all_to_all_single(torch.empty(n + 1), torch.ones(n + 1)),
        "equal blocks",
    )
    rep.raises(
        "a tensor on neither the CPU nor a GPU",
        ValueError,
        lambda: dist.all_reduce(torch.ones(2, device="meta")),
        "CPU and CUDA",
    )
    rep.raises(
        "a non-contiguous tensor",
        ValueError,
        lambda: dist.all_reduce(torch.ones(4, 4).t()),
        ".contiguous()",
    )
    rep.raises(
        "pp.init_torch_distributed twice",
        ValueError,
        lambda: pp.init_torch_distributed(world),
        "initialised already",
    )
    rep.raises(
        "shapes that disagree across ranks",
        pp.CollectiveMismatch,
        lambda: dist.all_reduce(torch.ones(2 + r)),
    )


def scenario(world: Any, rep: Report) -> None:
    import torch.distributed as dist

    pp.init_torch_distributed(world)
    rep.check(
        "torch sees the backend, the rank and the world size",
        (dist.get_backend(), dist.get_rank(), dist.get_world_size())
        == ("paramplane", world.rank, world.world_size),
        f"{dist.get_backend()} {dist.get_rank()} {dist.get_world_size()}",
    )
    _collectives(world, rep)
    _pp_wrappers(world, rep)
    _torch_ddp(world, rep)
    _torch_fsdp2(world, rep)
    _torch_tensor_parallel(world, rep)
    _torch_pipelining(world, rep)
    _errors(world, rep)
    dist.destroy_process_group()


def survive_a_crash(world: Any, rep: Report) -> None:
    """(argv ``crash``) Rank 1 dies of an exception after one all_reduce: the others' next ``dist`` call and an
    async one fail with WorldAborted naming it, not after the group timeout."""
    import torch
    import torch.distributed as dist

    pp.init_torch_distributed(world)
    dist.all_reduce(torch.ones(2))
    work = dist.all_reduce(torch.ones(2), async_op=True)
    rep.raises("an async call's wait() names the crash", pp.WorldAborted, work.wait, "bad batch at step 3")
    rep.raises(
        "a call after the crash names it",
        pp.WorldAborted,
        lambda: dist.all_reduce(torch.ones(2)),
        "rank 1 exited with ValueError: bad batch at step 3",
    )


def crash(world: Any) -> None:
    import torch
    import torch.distributed as dist

    pp.init_torch_distributed(world)
    dist.all_reduce(torch.ones(2))
    raise ValueError("bad batch at step 3")


if __name__ == "__main__":
    if sys.argv[1:] == ["crash"]:
        if os.environ["PARAMPLANE_RANK"] == "1":
            with pp.init() as crashing:
                crash(crashing)
        run_rank(survive_a_crash)
    else:
        run_rank(scenario)
