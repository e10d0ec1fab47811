"""The compose test's assertions, run inside a paramplane container by ``scripts/compose.sh test``.

The container mounts the checkpoint volume at ``/ckpt`` and the trace volume at ``/trace`` (a folder per run in
each) and the host's ``.compose/out`` at ``/out``, where the script leaves the nodes' logs (``RUN.log``) and
the coordinator's status snapshots. Exit status 0 when every check holds; each failed check prints ``FAILED: ...``.

    python compose_check.py RUN --steps N --save-every K --frames lane|grpc-stream [--same-as RUN0] [--resumed]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from paramplane.checkpoint import latest
from paramplane.checkpoint.__main__ import consolidate

OUT = Path("/out")
RANKS_PER_HOST = 2  # the coordinator places a host's ranks next to each other


def fail(message: str) -> None:
    print(f"FAILED: {message}")
    raise SystemExit(1)


def steps_check(log: str, num_steps: int, save_every: int, resumed: str | None) -> str:
    """Every step ran, and once per epoch; a resumed job recomputed at most one checkpoint interval."""
    by_world: dict[str, list[int]] = {}  # a world: one epoch of one coordinator (job id, epoch)
    for step, epoch, job in re.findall(r"\] step (\d+) of epoch (\d+) job (\S+)$", log, re.M):
        by_world.setdefault(f"epoch {epoch} of job {job}", []).append(int(step))
    if not by_world:
        fail("no 'step N of epoch E job J' lines in the logs (PARAMPLANE_LOG_EVERY=1?)")
    for world, steps in by_world.items():
        twice = [s for s, n in Counter(steps).items() if n > 1]
        if twice or steps != sorted(steps):
            fail(f"{world} ran steps out of order or twice: {twice or steps}")
    epochs = sorted(by_world, key=lambda w: min(by_world[w]))
    done = sorted(set().union(*map(set, by_world.values())))
    if done != list(range(1, num_steps + 1)):
        missing = sorted(set(range(1, num_steps + 1)) - set(done))
        fail(f"steps missing from the job: {missing[:10]}")
    if not resumed:
        if len(epochs) != 1 or "resumed from" in log:
            fail(f"an unbroken run ran in {epochs}")
        return f"{num_steps} steps in {epochs[0]}"
    if len(epochs) < 2:
        fail(f"the job never restarted: it ran in {epochs}")
    if resumed == "launcher" and "restarting every rank" not in log:
        fail("no launcher restarted its ranks")
    first, last = by_world[epochs[0]], by_world[epochs[-1]]
    found = re.findall(r"resumed from /ckpt/\S*step_(\d+) at step (\d+)", log)
    if not found:
        fail("no rank resumed from a checkpoint")
    resumed_at = last[0] - 1
    if str(resumed_at) not in {at for _, at in found}:
        fail(f"the last world began at step {last[0]}, but no rank resumed at step {resumed_at}: {found}")
    # "step N" is printed once step N and its checkpoint (if any) are done: a failure before step N's
    # checkpoint was committed resumes from the one before (a whole interval again), one after it from step N.
    recomputed = max(first) - resumed_at
    if resumed_at % save_every or not -1 <= recomputed <= save_every:
        fail(
            f"resumed at step {resumed_at} after step {max(first)}: not the newest checkpoint (every {save_every})"
        )
    return (
        f"{epochs[0]} ran steps 1..{max(first)}, {epochs[-1]} resumed from step_{resumed_at} "
        f"and ran {last[0]}..{last[-1]}: {recomputed} steps recomputed (interval {save_every})"
    )


def transport_check(run: str, log: str, frames: str) -> str:
    """Inter-host HybridShard traffic rode ``frames``; intra-host traffic rode shared memory."""
    lines = re.findall(r"transport: rank (\d+) host (\d+) frames (\S+) links (\S+)", log)
    if len(lines) < 2 * RANKS_PER_HOST:
        fail(f"{len(lines)} ranks reported their transport, expected {2 * RANKS_PER_HOST}")
    for rank, _host, ride, links in lines[-2 * RANKS_PER_HOST :]:
        kinds = set(links.split(","))  # lanes: TCP to the other host, Unix ones inside a host
        if frames == "grpc-stream":
            ok = kinds == {"grpc-stream"}
        else:
            ok = "lane-tcp" in kinds and kinds <= {"lane-tcp", "lane-unix"}
        if ride != frames or not ok:
            fail(f"rank {rank}: frames {ride}, links {links}; expected {frames}")
    seen: dict[str, Counter[str]] = {"inter-host": Counter(), "intra-host": Counter()}
    files = sorted((Path("/trace") / run).glob("rank-*.json"))
    if not files:
        fail(f"no traces in /trace/{run}")
    for f in files:
        for event in json.loads(f.read_text())["traceEvents"]:
            label = re.fullmatch(r"g\[([\d-]+)\](?:#\d+)?", str(event.get("tid", "")))
            if event.get("cat") != "collective" or label is None:
                continue
            members = [int(r) for r in label.group(1).split("-")]
            if len(members) != 2:
                continue  # the world group (hierarchical) is neither
            hosts = {r // RANKS_PER_HOST for r in members}
            seen["inter-host" if len(hosts) == 2 else "intra-host"][event["args"]["transport"]] += 1
    if set(seen["inter-host"]) != {frames} or set(seen["intra-host"]) != {"shm"}:
        fail(f"traced transports {dict((k, dict(v)) for k, v in seen.items())}; expected {frames} / shm")
    return "; ".join(f"{k}: {dict(v)}" for k, v in seen.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--frames", choices=("lane", "grpc-stream"), required=True)
    p.add_argument("--same-as", default=None, help="a run whose final parameters these must equal bitwise")
    p.add_argument(
        "--resumed",
        choices=("launcher", "operator"),
        default=None,
        help="the run was broken and resumed: its launchers restarted the ranks, or the nodes were restarted",
    )
    args = p.parse_args(argv)
    log = (OUT / f"{args.run}.log").read_text()
    print(f"{args.run}: steps: {steps_check(log, args.steps, args.save_every, args.resumed)}")
    print(f"{args.run}: collectives by transport: {transport_check(args.run, log, args.frames)}")
    final = latest(Path("/ckpt") / args.run)
    if final is None or final.name != f"step_{args.steps}":
        fail(f"the newest committed checkpoint is {final}, not step_{args.steps}")
    consolidate(final, OUT / f"{args.run}.npz")
    if args.same_as:
        mine, theirs = np.load(OUT / f"{args.run}.npz"), np.load(OUT / f"{args.same_as}.npz")
        if sorted(mine.files) != sorted(theirs.files):
            fail(f"arrays differ: {sorted(mine.files)} vs {sorted(theirs.files)}")
        differ = [k for k in mine.files if mine[k].tobytes() != theirs[k].tobytes()]
        if differ:
            fail(f"final parameters differ from {args.same_as}'s: {differ}")
        print(f"{args.run}: {len(mine.files)} arrays of step_{args.steps} bitwise equal to {args.same_as}'s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
