"""The torch side of ``pipeline.py``: torch stage modules under ``pp.Pipeline`` and under the peer,
``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` at their
defaults) over gloo. Both run the same stand-in stage: a ``torch.nn.Module`` whose forward and backward are an
autograd function that waits a known time and records how long it ran, so each one's bubble is measured the
same way (idle = step time - the sum of those spans, per step the rank with the largest idle fraction)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

P = 2
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
Configs = list[tuple[str, int, Any, bool, int]]
Measured = Callable[..., dict[str, Any]]


def wait_stage(seconds: float, spans: list[float], module_spans: list[float] | None = None) -> Any:
    """A torch module that waits ``seconds`` in its forward and in its backward, appending each wait's
    measured length to ``spans``; it has a parameter (so a first stage runs its backward too). With
    ``module_spans``, also the length of each call of the module's own code: its ``forward`` from entry to
    return, and its backward function from entry to return (the stage's work as the numpy stages' traced
    spans count it, whichever runtime calls it; the autograd engine's nodes after that function are left out)."""
    import torch

    class WaitFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, seconds: float) -> Any:
            start = time.monotonic()
            time.sleep(seconds)
            ctx.seconds = seconds
            spans.append(time.monotonic() - start)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            start = time.monotonic()
            time.sleep(ctx.seconds)
            spans.append(time.monotonic() - start)
            out = grad.clone()
            if module_spans is not None:
                module_spans.append(time.monotonic() - start)
            return out, None

    class Wait(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x: Any) -> Any:
            start = time.monotonic()
            out = WaitFn.apply(x + self.w * 0, seconds)
            if module_spans is not None:
                module_spans.append(time.monotonic() - start)
            return out

    return Wait()


def _run_steps(
    step: Callable[[], None],
    barrier: Callable[[], None],
    spans: list[float],
    module_spans: list[float],
    n: int,
    expected: int,
) -> tuple[list[float], list[float], list[float], list[float]]:
    """``n`` + 1 timed steps (the first, a warm-up, is left out by the caller): step times, CPU times, busy
    (the waits), busy (the stage module's own code)."""
    times, busy, cpu, module_busy = [], [], [], []
    for _ in range(n + 1):
        barrier()
        spans.clear()
        module_spans.clear()
        t, c = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        # (torch's first step also runs each stage's forward once to learn the shapes: not measured)
        assert (len(spans) == expected and len(module_spans) == expected) or len(times) == 1, (
            f"expected {expected} compute spans, got {len(spans)} and {len(module_spans)}"
        )
        busy.append(sum(spans))
        module_busy.append(sum(module_spans))
    return times, cpu, busy, module_busy


def worker_torch(
    args: argparse.Namespace, configs: Configs, stage_ms: Callable[..., float], measured: Measured
) -> list[dict[str, Any]]:
    """The peer on this rank: every configuration without a microbatch group (torch has no such setting)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank = int(os.environ["PARAMPLANE_RANK"])
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=P)
    spans: list[float] = []
    module_spans: list[float] = []
    rows = []
    for schedule, v, group, split, m in configs:
        if group is not None:
            continue
        stage_s = stage_ms(args, v, split) / 1000
        stages = [
            pipelining.PipelineStage(
                wait_stage(stage_s, spans, module_spans), rank + c * P, P * v, torch.device("cpu")
            )
            for c in range(v)
        ]
        pipe = getattr(pipelining, TORCH_SCHEDULES[schedule])(
            stages if v > 1 else stages[0], m, loss_fn=torch.nn.functional.mse_loss
        )
        x = torch.zeros(m, 8)

        def step(pipe: Any = pipe, x: Any = x) -> None:
            pipe.step(x) if rank == 0 else pipe.step(target=x)

        times, cpu, busy, module_busy = _run_steps(
            step, dist.barrier, spans, module_spans, args.steps, 2 * m * v
        )
        rows.append(
            measured(
                schedule,
                m,
                v,
                times,
                cpu,
                split,
                busy_s=busy[1:],
                module_busy_s=module_busy[1:],
                torch_version=torch.__version__,
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return rows


def worker_torch_stages(
    args: argparse.Namespace, configs: Configs, stage_ms: Callable[..., float], measured: Measured
) -> list[dict[str, Any]]:
    """The same torch stand-in stages under ``pp.Pipeline`` (its defaults), same configurations as the peer."""
    import torch

    import paramplane as pp

    spans: list[float] = []
    module_spans: list[float] = []
    rows = []
    with pp.init() as world:
        g = world.group
        for schedule, v, group, split, m in configs:
            if group is not None:
                continue
            stage_s = stage_ms(args, v, split) / 1000
            chunks = [wait_stage(stage_s, spans, module_spans) for _ in range(v)]
            pipe = pp.Pipeline(
                chunks if v > 1 else chunks[0], g, schedule, m, loss_fn=torch.nn.functional.mse_loss
            )
            x = torch.zeros(m, 8)

            actions: list[dict[str, float]] = []  # per step: each action's stage span (for the replay)

            def step(pipe: Any = pipe, x: Any = x, actions: list[dict[str, float]] = actions) -> None:
                tracer = g.tracer
                seen = tracer.num_events
                pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
                events = tracer.events_since(seen)
                actions.append({e["name"]: e["dur"] / 1e6 for e in events if e["cat"] == "compute"})

            times, cpu, busy, module_busy = _run_steps(
                step, g.barrier, spans, module_spans, args.steps, 2 * m * v
            )
            rows.append(
                measured(
                    schedule,
                    m,
                    v,
                    times,
                    cpu,
                    split,
                    busy_s=busy[1:],
                    module_busy_s=module_busy[1:],
                    stage_busy_s=[sum(a.values()) for a in actions[1:]],
                    spans=actions[1:],
                    torch_version=torch.__version__,
                )
            )
    return rows
