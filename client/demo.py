"""``paramplane demo``: a 4-rank DDP (or, with ``--fsdp``, FSDP) training run on this machine, end to end.

Starts an embedded coordinator on 127.0.0.1, spawns ``--world-size`` rank processes
running ``examples/train_ddp.py`` (the script a user copies; the demo runs it as is),
and waits for them. Rank 0 shows a progress bar per epoch, prints the test accuracy
and saves the loss curve; the demo prints where.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

EXAMPLES = Path(importlib.import_module("paramplane.examples").__file__ or "").resolve().parent
EXAMPLE = EXAMPLES / "train_ddp.py"
FSDP_EXAMPLE = EXAMPLES / "train_fsdp.py"


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
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="train with FSDP full_shard (examples/train_fsdp.py) instead of DDP",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="collective timeout in seconds (default 120)"
    )
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
    example = FSDP_EXAMPLE if args.fsdp else EXAMPLE
    if not example.is_file():
        print(f"paramplane demo: {example} is missing from this installation", file=sys.stderr)
        return 1
    from paramplane.launch import LaunchConfig, launch

    os.environ["PARAMPLANE_TRANSPORT"] = args.transport
    config = LaunchConfig(
        num_ranks=args.world_size,
        target=str(example),
        args=("--epochs", str(args.epochs)) + (() if args.fsdp else ("--out", str(args.out))),
        standalone=True,
        timeout_s=args.timeout,
        prefix=args.fsdp,  # DDP: rank 0's progress bar redraws its line; prefixes would break it
    )
    print(
        f"paramplane demo: training with {'FSDP' if args.fsdp else 'DDP'} on {args.world_size} ranks",
        flush=True,
    )
    started = time.monotonic()
    code = launch(config)
    if code == 0:
        elapsed = time.monotonic() - started
        saved = "" if args.fsdp else f"; loss curve saved to {args.out / 'loss.png'}"
        print(f"paramplane demo: done in {elapsed:.1f} s{saved}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
