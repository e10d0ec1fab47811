"""A multi-process world for the DDP tests, and the rank-side scenarios they run.

``run_world(n, scenario, out)`` starts a world (``paramplane.local_world``) of ``n`` real rank
processes running ``python tests/_ddp_world.py SCENARIO OUT``; each rank saves what
it computed under ``OUT`` for the test to check. The model, data and training loop
are shared with the single-process reference the tests compute in-process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import paramplane as pp
from paramplane import local_world
from paramplane.local_world import RankRun
from paramplane.nn import CrossEntropyLoss, Linear, Module, Parameter, ReLU, Sequential
from paramplane.optim import SGD, AdamW
from paramplane.parallel.ddp import DDP, shard_range

HERE = Path(__file__).resolve()


def run_world(
    num_ranks: int,
    scenario: str,
    out: Path,
    *,
    env: dict[str, str] | None = None,
    per_rank_env: Callable[[int], dict[str, str]] | None = None,
    timeout: float = 90.0,
) -> list[RankRun]:
    """Run ``scenario`` on ``num_ranks`` processes (``paramplane.local_world``); all are gone when this returns."""
    world = local_world.run_world(
        num_ranks,
        lambda _rank: [sys.executable, str(HERE), scenario, str(out)],
        env={**os.environ, "PARAMPLANE_TIMEOUT": "30", "PARAMPLANE_JOIN_TIMEOUT": "30", **(env or {})},
        rank_env=per_rank_env,
        timeout_s=timeout,
        coordinator_options={"heartbeat_timeout_s": 20.0},
    )
    assert not world.timed_out, [r.output[-3000:] for r in world.ranks]
    return world.ranks


def check_ok(results: list[RankRun]) -> None:
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(f"rank {r.rank} exited {r.returncode}:\n{r.output[-3000:]}" for r in bad)


# -- model, data and the training loop (shared by the ranks and the reference) ------------------------
class SpareMLP(Module):
    """An MLP with a buffer and a parameter that forward never uses."""

    def __init__(self, seed: int, dtype: Any) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.net = Sequential(
            Linear(8, 16, dtype=dtype, rng=rng),
            ReLU(),
            Linear(16, 16, dtype=dtype, rng=rng),
            ReLU(),
            Linear(16, 5, dtype=dtype, rng=rng),
        )
        self.spare = Parameter(rng.standard_normal(3).astype(dtype))
        self.register_buffer("stat", np.full(4, float(seed), dtype=dtype))

    def forward(self, x: Any) -> Any:
        return self.net.forward(x)

    def backward(self, grad_out: Any) -> Any:
        return self.net.backward(grad_out)


CONFIGS = [
    # name, dtype, optimizer, micro-batches per step (>1: the first ones under no_sync, or for "_synced" each
    # synchronised, finish_gradient_sync() between them), bucket_mb
    ("sgd64", np.float64, "sgd", 1, 0.0005),
    ("adamw64", np.float64, "adamw", 1, 25.0),
    ("sgd64_accum", np.float64, "sgd", 2, 0.0005),
    ("adamw64_accum", np.float64, "adamw", 3, 0.001),
    ("sgd32", np.float32, "sgd", 1, 0.0005),
    ("adamw32_accum", np.float32, "adamw", 2, 25.0),
    ("sgd64_synced", np.float64, "sgd", 2, 0.0005),
]
NUM_STEPS = 3


def batches(global_batch: int, dtype: Any, num_micro: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per step, the micro-batches (x, y) of the global batch."""
    rng = np.random.default_rng(42)
    return [
        [
            (rng.standard_normal((global_batch, 8)).astype(dtype), rng.integers(0, 5, global_batch))
            for _ in range(num_micro)
        ]
        for _ in range(NUM_STEPS)
    ]


def make_optimizer(kind: str, params: list[Parameter]) -> Any:
    return SGD(params, lr=0.1, momentum=0.9) if kind == "sgd" else AdamW(params, lr=0.01, weight_decay=0.1)


def train_reference(cfg: tuple[Any, ...], global_batch: int) -> dict[str, np.ndarray]:
    """One process on the whole batch; gradients of micro-batches add up."""
    _, dtype, kind, num_micro, _ = cfg
    model = SpareMLP(0, dtype)
    opt = make_optimizer(kind, model.parameters())
    crit = CrossEntropyLoss("mean")
    for step in batches(global_batch, dtype, num_micro):
        opt.zero_grad()
        for x, y in step:
            crit.forward(model.forward(x), y)
            model.backward(crit.backward())
        opt.step()
    return model.state_dict()


def train_ranks(world: pp.World, cfg: tuple[Any, ...], global_batch: int) -> dict[str, np.ndarray]:
    name, dtype, kind, num_micro, bucket_mb = cfg
    g = world.group
    even = global_batch % g.size == 0
    model = SpareMLP(world.rank, dtype)  # differs per rank until DDP broadcasts rank 0's
    ddp = DDP(model, g, bucket_mb=bucket_mb, reduce_op="mean" if even else "sum")
    assert np.all(model.stat == 0), f"{name}: buffer not broadcast from rank 0: {model.stat}"
    opt = make_optimizer(kind, ddp.parameters())
    ddp.attach(opt)
    crit = CrossEntropyLoss("mean" if even else "sum")
    a, b = shard_range(global_batch, g.size, g.rank)
    for step in batches(global_batch, dtype, num_micro):
        opt.zero_grad()
        synced = name.endswith("_synced")
        for m, (x, y) in enumerate(step):
            last = m == num_micro - 1
            with ddp.no_sync() if not last and not synced else _nothing():
                crit.forward(ddp.forward(x[a:b]), y[a:b])  # forward re-broadcasts the buffer
                before = g._e.progress()[0]
                ddp.backward(crit.backward() if even else crit.backward(grad_scale=1.0 / global_batch))
            if synced:
                ddp.finish_gradient_sync()  # the next backward adds to reduced gradients
            elif not last:
                assert g._e.progress()[0] == before, f"{name}: no_sync backward issued a collective"
        opt.step()
        assert model.spare.grad is None, f"{name}: the unused parameter got a gradient"
    return model.state_dict()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def scenario_equiv(world: pp.World, out: Path) -> None:
    global_batch = {2: 12, 3: 13}.get(world.world_size, 4 * world.world_size)
    saved: dict[str, np.ndarray] = {}
    for cfg in CONFIGS:
        for key, value in train_ranks(world, cfg, global_batch).items():
            saved[f"{cfg[0]}/{key}"] = value
    np.savez(out / f"rank{world.rank}.npz", **saved)


def scenario_overlap(world: pp.World, out: Path) -> None:
    """Big enough layers that backward takes a while; small buckets; traced."""
    rng = np.random.default_rng(0)
    layers: list[Module] = []
    for _ in range(4):
        layers += [Linear(512, 512, rng=rng), ReLU()]
    model = Sequential(*layers, Linear(512, 10, rng=rng))
    ddp = DDP(model, world.group, bucket_mb=1.0)
    opt = SGD(ddp.parameters(), lr=0.01)
    ddp.attach(opt)
    crit = CrossEntropyLoss()
    x = rng.standard_normal((256, 512)).astype(np.float32)
    y = rng.integers(0, 10, 256)
    # Collectives issued (handed to the engine, from this thread) when backward starts and when the first
    # layer's backward starts: buckets that launched in between overlap the rest of the backward.
    issued: list[tuple[int, int]] = []
    first, first_backward = model[0], model[0].backward

    def backward_of_first_layer(grad_out: Any) -> Any:
        issued[-1] = (issued[-1][0], world.group._e.progress()[0])
        return first_backward(grad_out)

    object.__setattr__(first, "backward", backward_of_first_layer)
    for _ in range(3):
        opt.zero_grad()
        crit.forward(ddp.forward(x), y)
        issued.append((world.group._e.progress()[0], -1))
        ddp.backward(crit.backward())
        opt.step()
    (out / f"buckets{world.rank}.txt").write_text(repr(ddp.bucket_params()))
    (out / f"issued{world.rank}.txt").write_text(repr(issued))


def scenario_trace(world: pp.World, out: Path) -> None:
    """A fixed sequence of collectives for the trace test."""
    g = world.group
    x = np.ones(1000, np.float32)
    g.all_reduce(x)
    g.broadcast(np.zeros(10, np.int64), src=0)
    g.all_gather(np.zeros(3, np.float64))
    g.all_reduce(np.ones(5, np.float64), op="max", async_op=True).wait()


SCENARIOS = {"equiv": scenario_equiv, "overlap": scenario_overlap, "trace": scenario_trace}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    world = pp.init()
    try:
        SCENARIOS[scenario](world, out)
        world.group.barrier()
    finally:
        world.shutdown()


if __name__ == "__main__":
    main()
