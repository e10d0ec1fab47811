"""``paramplane demo``: a 4-rank DDP training run on this machine, end to end.

Starts an embedded coordinator on 127.0.0.1, spawns ``--world-size`` rank processes
running ``examples/train_ddp.py`` (the script a user copies; the demo runs it as is),
and waits for them. Rank 0 shows a progress bar per epoch, prints the test accuracy
and saves the loss curve; the demo prints where.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import paramplane

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
EXAMPLE = Path(paramplane.__file__).resolve().parent.parent / "examples" / "train_ddp.py"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paramplane demo",
        description="Train an MLP on scikit-learn's digits with DDP over a local world of ranks.",
    )
    parser.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
    parser.add_argument("--world-size", type=int, default=4, help="rank processes (default 4)")
    parser.add_argument(
        "--out", type=Path, default=Path("demo_out"), help="folder for loss.png (default demo_out)"
    )
    parser.add_argument(
        "--transport", choices=("auto", "grpc", "shm"), default="auto", help="data plane (default auto: shm)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is stopped")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every rank finished."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.epochs < 1 or args.world_size < 1 or not args.timeout > 0:
        print("paramplane demo: --epochs, --world-size and --timeout must be positive", file=sys.stderr)
        return 2
    if not EXAMPLE.is_file():
        print(f"paramplane demo: {EXAMPLE} is missing; the demo needs a source checkout", file=sys.stderr)
        return 1
    from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

    coord = CoordinatorThread(CoordinatorConfig(world_size=args.world_size, host="127.0.0.1", port=0))
    address = coord.start()
    print(f"paramplane demo: {args.world_size} ranks, coordinator {address}", flush=True)
    started = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(args.world_size):
            env = dict(
                os.environ,
                PARAMPLANE_COORDINATOR=address,
                PARAMPLANE_RANK=str(rank),
                PARAMPLANE_WORLD_SIZE=str(args.world_size),
                PARAMPLANE_TRANSPORT=args.transport,
                PARAMPLANE_TIMEOUT=str(min(args.timeout, 120.0)),
            )
            # One BLAS thread per rank when ranks outnumber cores: oversubscribed BLAS pools made
            # the run 5x slower on a 2-core machine. A user's own setting wins.
            threads = str(max(1, (os.cpu_count() or 1) // args.world_size))
            for var in THREAD_VARS:
                env.setdefault(var, threads)
            cmd = [sys.executable, str(EXAMPLE), "--epochs", str(args.epochs), "--out", str(args.out)]
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        code = _wait(procs, started + args.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        coord.stop()
    elapsed = time.monotonic() - started
    if code == 0:
        print(
            f"paramplane demo: done in {elapsed:.1f} s; loss curve saved to {args.out / 'loss.png'}",
            flush=True,
        )
    return code


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float) -> int:
    """0 once every rank exited 0; the first failure's status (the others are killed by the caller)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"paramplane demo: rank {rank} exited with {code}; stopping the others", file=sys.stderr)
            return code if code is not None and code > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            print("paramplane demo: timed out; stopping the ranks", file=sys.stderr)
            return 1
        try:
            next(p for p in procs if p.poll() is None).wait(0.2)
        except (subprocess.TimeoutExpired, StopIteration):
            pass


if __name__ == "__main__":
    sys.exit(main())
