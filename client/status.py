"""``paramplane status HOST:PORT``: the world as the coordinator sees it (like torchft's lighthouse page).

Prints the epoch, every rank by host with its last heartbeat, every group's progress (issued /
completed collectives per rank and how long each has been unchanged) and the abort reason, if any.
The job token comes from ``--token-file``, ``PARAMPLANE_TOKEN_FILE`` or ``PARAMPLANE_TOKEN``; ``PARAMPLANE_TLS_CA``
verifies a TLS coordinator.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from paramplane.health import ask


def fetch(address: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    """The coordinator's status as a plain dict (through the typed coordinator client, deadline ``timeout_s``)."""
    from google.protobuf.json_format import MessageToDict

    from paramplane.node.coord_client import ask_coordinator

    reply = ask_coordinator(address, token, lambda client: client.status(), timeout_s=timeout_s)
    return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def render(s: dict[str, Any]) -> str:
    lines = [f"epoch {s['epoch']}  job {s.get('job_id') or '-'}  world size {s['world_size']}"]
    if not s["formed"]:
        lines.append(f"not formed yet: {s['num_waiting']}/{s['world_size']} joined")
        return "\n".join(lines)
    lines[0] += f"  formed {s['formed_s_ago']:.1f} s ago"
    by_host: dict[str, list[dict[str, Any]]] = {}
    for r in s["ranks"]:
        by_host.setdefault(r["host_id"], []).append(r)
    for host, ranks in by_host.items():
        lines.append(f"host {host}:")
        for r in ranks:
            seen = "never" if r["since_heartbeat_s"] < 0 else f"{r['since_heartbeat_s']:.1f} s ago"
            left = "  (left)" if r["left"] else ""
            lines.append(
                f"  rank {r['rank']:>3}  {r['address']:<24} pid {r['pid']:<7} heartbeat {seen}{left}"
            )
    for g in s["groups"]:
        cells = ", ".join(
            f"{rank}: {i}/{c} ({u:.0f} s)"
            for rank, i, c, u in zip(g["ranks"], g["issued"], g["completed"], g["unchanged_s"])
        )
        lines.append(f"group {g['group']}: issued/completed per rank {cells}")
    if s["aborted"]:
        who = f" (rank {s['abort_rank']})" if s["abort_rank"] >= 0 else ""
        lines.append(f"ABORTED{who}: {s['abort_reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paramplane status", description=__doc__.splitlines()[0])
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--timeout", type=float, default=5.0, help="deadline in seconds (default 5)")
    parser.add_argument("--token-file", default=None, help="file holding the job token")
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    status = ask("status", args.address, args.token_file, args.timeout, fetch)
    if isinstance(status, int):
        return status
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
