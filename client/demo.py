"""``paramplane demo``: a 4-rank DDP (or, with ``--fsdp``, FSDP) training run on this machine, end to end.

Starts an embedded coordinator on 127.0.0.1, spawns ``--world-size`` rank processes
running ``examples/train_ddp.py`` (the script a user copies; the demo runs it as is),
and waits for them. Rank 0 shows a progress bar per epoch, prints the test accuracy
and saves the loss curve; the demo prints where.

``--torch`` runs ``examples/train_gpt.py`` instead, on 2 ranks by default: a small GPT (transformers'
GPT-2 when installed) under FSDP full_shard with torch's AdamW, clipping and bfloat16 autocast, saving a
checkpoint to ``--out``/gpt_checkpoints every ``--checkpoint-every`` steps; ``--resume`` continues from
the newest one.

``--diloco`` runs ``examples/train_diloco.py`` on two emulated hosts of 2 ranks each (an embedded
coordinator and one ``paramplane launch`` per host, each with its own host id): FSDP inside a host,
``pp.DiLoCo`` across the hosts every ``--sync-every`` steps; numpy only.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

EXAMPLES = Path(importlib.import_module("paramplane.examples").__file__ or "").resolve().parent
EXAMPLE = EXAMPLES / "train_ddp.py"
FSDP_EXAMPLE = EXAMPLES / "train_fsdp.py"
TORCH_EXAMPLE = EXAMPLES / "train_gpt.py"
DILOCO_EXAMPLE = EXAMPLES / "train_diloco.py"
DEMO_MODULES = ("sklearn", "tqdm", "matplotlib")
"""What the DDP/FSDP demo's examples import beyond paramplane (the ``demo`` extra)."""
DEMO_HINT = "pip install 'paramplane[demo]' (scikit-learn's digits, tqdm, matplotlib)"
TORCH_HINT = (
    "paramplane demo --torch needs torch: pip install torch "
    "(and pip install 'paramplane[test]' to train transformers' GPT-2 rather than the example's own GPT)"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paramplane demo",
        description="Train an MLP on scikit-learn's digits with DDP over a local world of ranks.",
    )
    parser.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
    parser.add_argument(
        "--world-size", type=int, default=None, help="rank processes (default 4; 2 with --torch)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("demo_out"),
        help="folder for loss.png, or --torch's gpt_checkpoints (default demo_out)",
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
        "--torch",
        action="store_true",
        help="train a small torch GPT with FSDP, AdamW and checkpoints (examples/train_gpt.py)",
    )
    parser.add_argument(
        "--diloco",
        action="store_true",
        help="FSDP inside 2 emulated hosts, DiLoCo across them (examples/train_diloco.py)",
    )
    parser.add_argument(
        "--sync-every", type=int, default=20, help="--diloco: inner steps between syncs (default 20)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="--torch: train up to this step (default 40); --diloco: 200"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=10, help="--torch: steps between checkpoints (default 10)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="--torch: continue from the newest checkpoint in --out"
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
    if args.world_size is None:
        args.world_size = 2 if args.torch else 4
    if args.steps is None:
        args.steps = 200 if args.diloco else 40
    numbers = (args.epochs, args.world_size, args.steps, args.checkpoint_every, args.sync_every)
    if min(numbers) < 1 or not args.timeout > 0:
        print(
            "paramplane demo: --epochs, --world-size, --steps, --checkpoint-every, --sync-every and --timeout "
            "must be positive",
            file=sys.stderr,
        )
        return 2
    if args.diloco:
        from paramplane.demo_diloco import run

        return run(args.steps, args.sync_every, args.timeout)
    if args.torch:
        return _torch_demo(args)
    missing = [m for m in DEMO_MODULES if importlib.util.find_spec(m) is None]
    if missing:  # the examples' imports would fail in every rank, one traceback each
        print(f"paramplane demo needs {', '.join(missing)}: {DEMO_HINT}", file=sys.stderr)
        return 1
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


def _torch_demo(args: argparse.Namespace) -> int:
    """``--torch``: examples/train_gpt.py on ``--world-size`` ranks, checkpoints under ``--out``."""
    if importlib.util.find_spec("torch") is None:
        print(TORCH_HINT, file=sys.stderr)
        return 1
    if not TORCH_EXAMPLE.is_file():
        print(f"paramplane demo: {TORCH_EXAMPLE} is missing from this installation", file=sys.stderr)
        return 1
    from paramplane.checkpoint import latest
    from paramplane.launch import LaunchConfig, launch

    ckpt = args.out / "gpt_checkpoints"
    newest = latest(ckpt)
    if newest is not None and not args.resume:
        print(
            f"paramplane demo: {ckpt} holds a checkpoint of an earlier run ({newest.name}): pass --resume "
            "(with a larger --steps) to continue it, or another --out",
            file=sys.stderr,
        )
        return 2
    os.environ["PARAMPLANE_TRANSPORT"] = args.transport
    flags = ["--steps", str(args.steps), "--checkpoint-dir", str(ckpt)]
    flags += ["--checkpoint-every", str(args.checkpoint_every)] + (["--resume"] if args.resume else [])
    config = LaunchConfig(
        num_ranks=args.world_size,
        target=str(TORCH_EXAMPLE),
        args=tuple(flags),
        standalone=True,
        timeout_s=args.timeout,
        prefix=True,
    )
    print(f"paramplane demo: training a torch GPT with FSDP on {args.world_size} ranks", flush=True)
    started = time.monotonic()
    code = launch(config)
    if code == 0:
        elapsed = time.monotonic() - started
        print(f"paramplane demo: done in {elapsed:.1f} s; checkpoints in {ckpt}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
