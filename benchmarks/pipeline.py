"""Pipeline bubble: measured idle fraction of a step against theory, per schedule and microbatch count.

    python benchmarks/pipeline.py [--compute-ms 20] [--steps 5] [--schedules gpipe,1f1b,interleaved_1f1b]
                                  [--poll-us 0] [--no-torch] [--repeats 1] [--out benchmarks/results/pipeline.jsonl]

p = 2 ranks, one stage each (interleaved: v = 2 chunks each, the p*v stages placed stage s on rank
s mod p). Every stage spends a fixed, known time per microbatch in forward and in backward
(``--compute-ms``), a chunk of an interleaved rank as well (``stage_ms``); interleaved 1F1B runs once more
with each rank's work split over its chunks (``split_rank_work``: ``--compute-ms`` / v per chunk, the same
work per rank and microbatch as GPipe and 1F1B, so twice the relative weight of each transfer). The time is
a wait, not arithmetic:
two ranks spinning on this 2-core machine would distort the schedule with core contention, which
is not what this measures. Bubble fraction = idle time / step time, where a rank's busy time is the
sum of its forward and backward spans in the pipeline's trace events (``PARAMPLANE_TRACE``) and
everything else in the step (waiting for a neighbour, issuing transfers, the runtime's bookkeeping)
is idle; per step the rank with the largest fraction counts, and the median over steps is reported.
``bubble_nominal`` also charges the stages' sleep overshoot to the bubble: 1 - nominal compute / step
time. Theory (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m + p-1) for interleaved 1F1B.
A sleep here overshoots by 0.1-0.7 ms and now and then by several, and where a schedule leaves no
slack a neighbour's overshoot is this rank's idle time; ``bubble_replay`` replays each step's
measured spans through the schedule with free transfers (``schedules.simulate``), which is the
bubble those stages would give with a perfect runtime, and ``runtime_ms_per_step`` is how much longer
the real step took than that replay (transfers and the runtime's work around them).
Also the measured peak of live activation sets on the first stage, and the one-way time of a small
message measured in the same run (``p2p_one_way_ms``: each dependent transfer on a schedule's
critical path adds about that much), ``cold_code_us`` (``cold_code_s``: how slow code that has not run for
10 ms is on this host at the time, what the runtime's steps between computes pay), ``poll_us`` (``Pipeline(poll_us=...)``: the transfer threads wait in
slices of that many microseconds during a step; 0, the default, sleeps until woken) and what it costs:
``cpu_ms_per_step``, the CPU time the slowest rank's process spent per step (all its threads).
The peer, in the same run unless ``--no-torch`` (or torch is not installed): torch.distributed.pipelining
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, each at its defaults) over gloo, its stages
the same stand-in as an autograd function, its bubble measured the same way from those functions' spans
(``impl: "torch"`` lines; torch has no microbatch group setting). Our lines carry
``torch_measured_over_theory`` and ``bubble_over_torch`` (our bubble / torch's) for the same schedule and m.
Also in that run: the very same torch stand-in modules as torch stages of ``pp.Pipeline`` (``impl:
"paramplane-torch-stages"``: autograd inside each stage, activations across as DLPack views), measured like
the peer, with their ``bubble_over_torch``. Both torch rows also count busy the way the numpy rows do, as
the stage module's own code (``module_spans_over_theory``: its forward from entry to return and its backward
function, recorded by the stand-in itself under either runtime, so the module's torch work is busy and each
runtime's own work around it idle), with ``module_spans_over_torch`` (ours / torch's), and as the stage's
torch work (``work_spans_over_theory``, ``work_spans_over_torch``: its forward, the ``loss_fn`` call and each
call of torch's autograd engine for its backward, which the module spans leave idle: ``_pipeline_torch.py``).
One JSON line per configuration and implementation, and per repeat: ``--repeats N`` runs every
implementation N times, the peer and our torch stages taking turns to go first (each line carries ``repeat``
and the host's 1-minute load average before that repeat, ``load_avg_1min``; ratios to torch within a repeat).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.benchmarks._jsonl import emit
from paramplane.benchmarks._pipeline_torch import worker_torch, worker_torch_stages
from paramplane.local_world import json_lines, run_world

P = 2
# (schedule, chunks per rank, microbatch_group, split_rank_work): interleaved 1F1B at its default groups of p
# microbatches, at groups of 2p (more slack for each transfer, more live activations on the first stage), and at
# its default groups with each rank's work split over its chunks instead of every chunk a whole stage's.
CONFIGS: list[tuple[str, int, int | None, bool]] = [
    ("gpipe", 1, None, False),
    ("1f1b", 1, None, False),
    ("interleaved_1f1b", 2, None, False),
    ("interleaved_1f1b", 2, 2 * P, False),
    ("interleaved_1f1b", 2, None, True),
]


def worker(args: argparse.Namespace) -> None:
    import paramplane as pp
    from paramplane.nn import Module, MSELoss

    class Wait(Module):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds = seconds

        def forward(self, x: Any) -> Any:
            self._save(mark=True)
            time.sleep(self.seconds)
            return x.copy()

        def backward(self, grad: Any) -> Any:
            self._take_saved()
            time.sleep(self.seconds)
            return grad.copy()

    rows = []
    with pp.init() as world:
        one_way = p2p_one_way_s(world.group)
        cold = cold_code_s()
        for schedule, v, group, split, m in _configs(args):
            stage_s = _stage_ms(args, v, split) / 1000
            chunks = [Wait(stage_s) for _ in range(v)]
            pipe = pp.Pipeline(
                chunks if v > 1 else chunks[0],
                world.group,
                schedule,
                m,
                MSELoss(),
                microbatch_group=group,
                poll_us=args.poll_us,
            )
            x = np.zeros((m, 8))
            times, spans, cpu = [], [], []
            tracer = world.group.tracer
            for _ in range(args.steps + 1):
                world.group.barrier()
                seen = tracer.num_events
                t, c = time.perf_counter(), time.process_time()
                pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
                mine = {e["name"]: e["dur"] / 1e6 for e in tracer.events_since(seen) if e["cat"] == "compute"}
                assert len(mine) == 2 * m * v, f"expected {2 * m * v} compute spans, got {len(mine)}"
                spans.append(mine)
            rows.append(
                _measured(
                    schedule,
                    m,
                    v,
                    times,
                    cpu,
                    split,
                    microbatch_group=group,
                    spans=spans[1:],
                    compute_s=m * v * 2 * stage_s,
                    peak_activation_sets=pipe.memory_stats()["peak_activation_sets"],
                    p2p_one_way_s=one_way,
                    cold_code_s=cold,
                )
            )
    print(json.dumps(rows), flush=True)


def _measured(
    schedule: str, m: int, v: int, times: list[float], cpu: list[float], split: bool, **more: Any
) -> dict[str, Any]:
    """One rank's measurements of one configuration (its first, warm-up step left out)."""
    return {
        "schedule": schedule,
        "m": m,
        "v": v,
        "split_rank_work": split,
        "step_s": times[1:],
        "cpu_s": cpu[1:],
        **more,
    }


def _configs(args: argparse.Namespace) -> list[tuple[str, int, int | None, bool, int]]:
    """The (schedule, chunks per rank, microbatch group, split_rank_work, microbatches) this run measures."""
    return [
        (schedule, v, group, split, m)
        for schedule, v, group, split in CONFIGS
        if schedule in args.schedules.split(",")
        for m in [int(x) for x in args.microbatches.split(",")]
        if not ((schedule != "gpipe" and m < P) or (group is not None and m % group))
    ]


def _stage_ms(args: argparse.Namespace, v: int, split: bool) -> float:
    """Each stage's (chunk's) compute per microbatch, forward and backward each."""
    return args.compute_ms / v if split else args.compute_ms


def cold_code_s(rounds: int = 50) -> float:
    """Median time of a fixed bit of interpreter work (a 50-element list comprehension) run once after each
    10 ms sleep: how slow code runs that has not run for a while, which on a shared host depends on what
    else runs there (2 µs when it runs back to back). Every step of the runtime between two computes pays
    it, so the bubble's distance from theory follows it."""
    times = []
    for _ in range(rounds):
        time.sleep(0.01)
        start = time.perf_counter()
        _ = [i for i in range(50)]
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def p2p_one_way_s(group: Any, rounds: int = 300) -> float:
    """Median one-way time of a small message between the two ranks (ping-pong): the latency each
    dependent transfer of a schedule adds, measured in the same run as the schedules."""
    x, peer, times = np.zeros((1, 8)), 1 - group.rank, []
    for _ in range(rounds):
        t = time.perf_counter()
        if group.rank == 0:
            group.send(x, peer)
            group.recv(x, peer)
        else:
            group.recv(x, peer)
            group.send(x, peer)
        times.append((time.perf_counter() - t) / 2)
    return float(np.median(times))


def _bubbles(
    schedule: str, m: int, v: int, group: int | None, rows: Sequence[dict[str, Any]]
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per step: the measured bubble (the rank with the largest idle fraction of its own step), the bubble
    of a replay of the same compute spans with free transfers (``schedules.simulate``: what the stages'
    own timing jitter costs), the slowest rank's step time, and the replay's."""
    from paramplane.parallel.pipeline import schedules

    lists = [schedules.build(schedule, r, P, m, v, group) for r in range(P)]
    measured, replayed, steps, ideals = [], [], [], []
    for i in range(len(rows[0]["step_s"])):
        busy = [sum(r["spans"][i].values()) for r in rows]
        measured.append(max(1.0 - b / r["step_s"][i] for b, r in zip(busy, rows)))
        durations: dict[str, float] = {name: d for r in rows for name, d in r["spans"][i].items()}
        ideal = max(schedules.simulate(lists, functools.partial(_span, durations)))
        replayed.append(max(1.0 - b / ideal for b in busy))
        steps.append(max(r["step_s"][i] for r in rows))
        ideals.append(ideal)
    return measured, replayed, steps, ideals


def _span(durations: dict[str, float], action: Any) -> float:
    return durations[str(action)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compute-ms", type=float, default=20.0, help="each stage's forward (and backward) per microbatch"
    )
    parser.add_argument("--microbatches", default="2,4,8,16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b", help="comma-separated")
    parser.add_argument("--poll-us", type=int, default=0, help="Pipeline(poll_us=...)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.distributed.pipelining rows")
    parser.add_argument(
        "--repeats", type=int, default=1, help="run every implementation this many times, taking turns"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=("paramplane", "torch", "torch-stages"), help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.worker == "paramplane":
        worker(args)
        return 0
    if args.worker in ("torch", "torch-stages"):
        run = worker_torch if args.worker == "torch" else worker_torch_stages
        print(json.dumps(run(args, _configs(args), _stage_ms, _measured)), flush=True)
        return 0
    cmd = [
        sys.executable,
        __file__,
        "--compute-ms",
        str(args.compute_ms),
        "--microbatches",
        args.microbatches,
    ]
    cmd += ["--steps", str(args.steps), "--schedules", args.schedules, "--poll-us", str(args.poll_us)]
    lines = []
    for repeat in range(args.repeats):
        # The peer and our torch stages take turns going first, so a load that drifts during a run does not
        # always favour the same one.
        lines += _one_run(args, cmd, repeat, peer_first=repeat % 2 == 0)
    emit(lines, args.out)
    return 0


def _one_run(args: argparse.Namespace, cmd: list[str], repeat: int, *, peer_first: bool) -> list[str]:
    """Every implementation once: its lines, with ``repeat`` and the host's 1-minute load average before."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="paramplane-pipeline-trace-") as trace:
        env = dict(os.environ, PARAMPLANE_TRACE=trace)
        per_rank = json_lines(
            run_world(
                P, lambda _r: [*cmd, "--worker", "paramplane"], env=env, timeout_s=1800.0, stderr="inherit"
            ),
            "pipeline benchmark",
        )
    peer: dict[tuple[str, int, bool], dict[str, Any]] = {}
    torch_stage_lines: list[str] = []
    if not args.no_torch and importlib.util.find_spec("torch") is not None:
        torch_ranks: list[Any] = []
        stage_ranks: list[Any] = []
        for which in ("torch", "torch-stages") if peer_first else ("torch-stages", "torch"):
            (torch_ranks if which == "torch" else stage_ranks).extend(_torch_world(cmd, which))
        for rows in zip(*torch_ranks):
            row = _torch_row(rows, args, "torch")
            peer[(row["schedule"], row["m"], row["split_rank_work"])] = row
        for rows in zip(*stage_ranks):
            row = _torch_row(rows, args, "paramplane-torch-stages")
            theirs = _peer_of(peer, row)
            if theirs is not None:
                row["torch_measured_over_theory"] = theirs["measured_over_theory"]
                row["bubble_over_torch"] = row["bubble_measured"] / theirs["bubble_measured"]
                row["torch_module_spans_over_theory"] = theirs["module_spans_over_theory"]
                row["module_spans_over_torch"] = row["bubble_module_spans"] / theirs["bubble_module_spans"]
                row["torch_work_spans_over_theory"] = theirs["work_spans_over_theory"]
                row["work_spans_over_torch"] = row["bubble_work_spans"] / theirs["bubble_work_spans"]
            torch_stage_lines.append(json.dumps(row | {"repeat": repeat, "load_avg_1min": load}))
    lines = []
    for rows in zip(*per_rank):
        row = _row(rows, args)
        theirs = _peer_of(peer, row)
        if theirs is not None:
            row["torch_measured_over_theory"] = theirs["measured_over_theory"]
            row["bubble_over_torch"] = row["bubble_measured"] / theirs["bubble_measured"]
        lines.append(json.dumps(row | {"repeat": repeat, "load_avg_1min": load}))
    extra = {"repeat": repeat, "load_avg_1min": load}
    return lines + torch_stage_lines + [json.dumps(row | extra) for row in peer.values()]


def _peer_of(peer: dict[tuple[str, int, bool], dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """torch's row for the configuration of our ``row``; None for a microbatch group (torch has no such setting)."""
    if row["microbatch_group"] is not None:
        return None
    return peer.get((row["schedule"], row["m"], row["split_rank_work"]))


def _torch_world(cmd: list[str], which: str) -> list[Any]:
    """One world of the peer (``"torch"``: torch.distributed.pipelining over gloo) or of our torch stages
    (``"torch-stages"``: the same stand-in stages under pp.Pipeline, measured the same way): each rank's rows."""
    with tempfile.TemporaryDirectory(prefix="paramplane-pipeline-torch-") as tmp:
        if which == "torch":
            extra, env, coordinator = ["--store", os.path.join(tmp, "store")], dict(os.environ), False
        else:
            extra, env, coordinator = [], dict(os.environ, PARAMPLANE_TRACE=tmp), True
        return json_lines(
            run_world(
                P,
                lambda _r: [*cmd, "--worker", which, *extra],
                env=env,
                coordinator=coordinator,
                timeout_s=1800.0,
                stderr="inherit",
            ),
            "torch pipeline peer" if which == "torch" else "torch stages",
        )


def _theory(m: int, v: int) -> float:
    return (P - 1) / (v * m + P - 1) if v > 1 else (P - 1) / (m + P - 1)


def _row(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Our line for one configuration from every rank's measurements."""
    first = rows[0]
    m, v = first["m"], first["v"]
    bubble, replayed, steps, ideal = _bubbles(first["schedule"], m, v, first["microbatch_group"], rows)
    measured, step = float(np.median(bubble)), float(np.median(steps))
    theory = _theory(m, v)
    return {
        "bench": "pipeline",
        "impl": "paramplane",
        "schedule": first["schedule"],
        "microbatch_group": first["microbatch_group"],
        # Ranks of one machine meet on Unix-socket lanes unless PARAMPLANE_UNIX_LANE=0 (TCP, the inter-host path).
        "unix_lane": os.environ.get("PARAMPLANE_UNIX_LANE", "1") != "0",
        "p": P,
        "m": m,
        "v": v,
        "compute_ms": args.compute_ms,
        "split_rank_work": first["split_rank_work"],
        "stage_ms": _stage_ms(args, v, first["split_rank_work"]),
        "step_s": step,
        "bubble_measured": measured,
        "bubble_nominal": 1.0 - first["compute_s"] / step,
        "bubble_theory": theory,
        "measured_over_theory": measured / theory,
        "bubble_replay": float(np.median(replayed)),
        "replay_over_theory": float(np.median(replayed)) / theory,
        "runtime_ms_per_step": float(np.median([s - i for s, i in zip(steps, ideal)])) * 1e3,
        "peak_activation_sets_first_stage": first["peak_activation_sets"],
        "p2p_one_way_ms": first["p2p_one_way_s"] * 1e3,
        "cold_code_us": max(r["cold_code_s"] for r in rows) * 1e6,
        "poll_us": args.poll_us,
        "cpu_ms_per_step": max(float(np.median(r["cpu_s"])) for r in rows) * 1e3,
    }


def _torch_row(rows: Sequence[dict[str, Any]], args: argparse.Namespace, impl: str) -> dict[str, Any]:
    """A line from the torch stand-in's spans: the peer's (``impl`` "torch") or torch stage modules under
    ``pp.Pipeline`` ("paramplane-torch-stages"); per step the rank with the largest idle fraction."""
    first = rows[0]
    m, v = first["m"], first["v"]
    steps = range(len(first["step_s"]))
    bubble = [max(1.0 - r["busy_s"][i] / r["step_s"][i] for r in rows) for i in steps]
    measured, theory = float(np.median(bubble)), _theory(m, v)
    # Busy = the stage module's own code (its forward, its backward function), as the numpy rows count theirs.
    module = float(
        np.median([max(1.0 - r["module_busy_s"][i] / r["step_s"][i] for r in rows) for i in steps])
    )
    # Busy = the stage's torch work (its forward, the loss, torch's autograd engine computing its backward).
    torch_work = float(
        np.median([max(1.0 - r["work_busy_s"][i] / r["step_s"][i] for r in rows) for i in steps])
    )
    more: dict[str, Any] = {
        "bubble_module_spans": module,
        "module_spans_over_theory": module / theory,
        "bubble_work_spans": torch_work,
        "work_spans_over_theory": torch_work / theory,
    }
    if (
        "stage_busy_s" in first
    ):  # torch stages under pp.Pipeline: also busy as the numpy stages' rows count it
        spans = [max(1.0 - r["stage_busy_s"][i] / r["step_s"][i] for r in rows) for i in steps]
        work = [max(r["stage_busy_s"][i] - r["busy_s"][i] for r in rows) for i in steps]
        group = first.get("microbatch_group")
        replay = _bubbles(first["schedule"], m, v, group, rows)[1]  # the same spans, transfers free
        more |= {
            "bubble_stage_spans": float(np.median(spans)),
            "stage_spans_over_theory": float(np.median(spans)) / theory,
            "replay_over_theory": float(np.median(replay)) / theory,
            "torch_work_ms_per_step": float(np.median(work)) * 1e3,
        }
    return {
        "bench": "pipeline",
        "impl": impl,
        "torch_version": first["torch_version"],
        "backend": "gloo" if impl == "torch" else "paramplane",
        "schedule": first["schedule"],
        "microbatch_group": first.get("microbatch_group"),
        "p": P,
        "m": m,
        "v": v,
        "compute_ms": args.compute_ms,
        "split_rank_work": first["split_rank_work"],
        "stage_ms": _stage_ms(args, v, first["split_rank_work"]),
        "step_s": float(np.median([max(r["step_s"][i] for r in rows) for i in range(len(bubble))])),
        "bubble_measured": measured,
        "bubble_theory": theory,
        "measured_over_theory": measured / theory,
        "cpu_ms_per_step": max(float(np.median(r["cpu_s"])) for r in rows) * 1e3,
        **more,
    }


if __name__ == "__main__":
    sys.exit(main())
