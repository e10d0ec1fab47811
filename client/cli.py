"""The ``paramplane`` console script: one entry point, one subcommand per tool.

Each subcommand's implementation is imported only when it runs, so that
``paramplane --help`` and the launcher start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from paramplane import __version__

# name -> (one-line help, module whose ``main(argv) -> int`` implements it)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "coordinator": (
        "run the job coordinator (rendezvous, KV store, heartbeats)",
        "paramplane.coordinator.cli",
    ),
    "launch": ("start N rank processes of a script on this host (like torchrun)", "paramplane.launch"),
    "env": (
        "print this process's rank, world size, node and coordinator as pp.init() finds them, and from where",
        "paramplane.placement",
    ),
    "demo": (
        "the main job: DDP (or --fsdp) training on 4 local ranks (scikit-learn digits); --torch: a GPT; "
        "--diloco: DiLoCo across 2 emulated hosts",
        "paramplane.demo",
    ),
    "bench": ("run a benchmark from benchmarks/ (`paramplane bench` lists them)", "paramplane.bench"),
    "trace": ("tools for PARAMPLANE_TRACE timelines (trace merge DIR)", "paramplane.trace"),
    "status": (
        "print the world as the coordinator at HOST:PORT sees it (ranks, heartbeats, progress)",
        "paramplane.status",
    ),
    "health": (
        "exit 0 when the coordinator at HOST:PORT is serving (container health checks)",
        "paramplane.health",
    ),
}


def _parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in SUBCOMMANDS) + 2
    listing = "\n".join(f"  {name:<{width}}{help_text}" for name, (help_text, _) in SUBCOMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="paramplane",
        usage="paramplane [-h] [--version] COMMAND [ARGS ...]",
        description="paramplane: an asyncio + gRPC parameter plane for distributed training.",
        epilog=f"commands:\n{listing}\n\nRun 'paramplane COMMAND --help' for the options of one command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"paramplane {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``paramplane COMMAND ...`` and return its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[args[0]][1])
        command: Callable[[list[str]], int] = module.main
        return command(args[1:])
    parser = _parser()
    if not args:
        parser.print_help(sys.stderr)
        return 2
    try:
        if not args[0].startswith("-"):
            parser.error(
                f"unknown command {args[0]!r}; choose from {', '.join(SUBCOMMANDS)} (see paramplane --help)"
            )
        parser.parse_args(args)  # --help, --version, or an error about an unknown option: each exits
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
