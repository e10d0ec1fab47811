"""The control plane at 64 to 4,096 ranks on one coordinator process, beside torch's TCPStore (libuv).

Simulated ranks: many light asyncio clients per process, each speaking the real protocol through the
project's own ``CoordinatorClient`` (join, heartbeats with progress at the coordinator's interval, a Watch
stream, barriers, KV waits), against a real ``paramplane coordinator`` process at its defaults. Ranks are
spread over H simulated hosts (host ids) and P simulator processes. Per world size it measures:

- ``join_s``: first join call to the last rank holding its rank;
- ``barrier_s``: a world barrier, from the last arrival to the last release;
- ``uid_world_s`` / ``uid_host_s``: a 128-byte unique id (NCCL's) set by one rank, from the set to the last
  rank holding it: one world group, then one group per host at once;
- these three are the median of ``--rounds`` rounds (default 5, every implementation alike; each round's
  figure is in the row too); ``barrier_first_s`` is the first barrier after the joins, apart
  (``_control_plane_rounds.py``);
- ``cpu_steady``: the coordinator's CPU (fraction of one core) over a steady window in which every rank
  heartbeats (default interval) and holds its Watch stream; ``rss_mb``: its resident memory then;
- ``detect_s``: one rank stops heartbeating; until every other rank has the abort naming it (the
  coordinator's heartbeat timeout, default 10 s, is the bound).

With ``--impls agent`` the same runs through host agents (``paramplane launch --coordinator``'s design): one
``HostAgent`` per simulated host batches its ranks' joins, heartbeats and barrier arrivals into one call per
host, holds one Watch stream per host and shares one waiting get per key (``_control_plane_agent.py``); rows
say ``paramplane-agent``. Its simulated ranks call the agent's service methods in process: the rank-to-agent
hop (a Unix socket, on a real host run by the host's own cores) is left out. ``--impls agent-hop`` puts it in:
each simulated rank is then a ``CoordinatorClient`` of its agent's Unix socket, as a rank process is (rows say
``paramplane-agent-hop``); that hop's work then shares this machine's cores with the coordinator.

TCPStore (libuv server in its own process; one client per simulated rank, threads in P processes) runs the
same rendezvous (``add`` + ``wait``, as torch's static rendezvous does), barrier and unique-id fan-outs.
Output: JSON lines (``--out`` appends them), each with the host's 1-minute load average before and after its
run (``load_avg_1m``: the simulators share the coordinator's cores); ``--plot`` draws the log-log figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from paramplane.benchmarks._control_plane_rounds import ROUNDS, new_out, plan, summary
from paramplane.benchmarks._jsonl import emit

TIMEOUT_S = 300.0
STEADY_S = 8.0
UID = b"u" * 128


def _hosts_for(n: int) -> int:
    return min(64, max(8, n // 64))


def _procs_for(n: int, hosts: int) -> int:
    return min(hosts, 4)


def _ready_then_go() -> None:
    """Tell the parent this simulator has imported everything, then wait for every simulator to be ready."""
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go from the parent")


def _my_ranks(n: int, hosts: int, procs: int, index: int) -> list[tuple[int, int]]:
    """(rank, host) pairs simulated by process ``index``: whole hosts, ranks consecutive per host."""
    per_host = n // hosts
    mine = [h for h in range(hosts) if h % procs == index]
    return [(h * per_host + i, h) for h in mine for i in range(per_host)]


# -- paramplane simulator ---------------------------------------------------------------------------------------
async def _sim_paramplane(
    address: str,
    n: int,
    hosts: int,
    procs: int,
    index: int,
    steady_s: float = STEADY_S,
    rounds: int = ROUNDS,
    agents: dict[int, str] | None = None,
) -> dict[str, Any]:
    """The ranks of simulator ``index``, each a ``CoordinatorClient`` of ``address`` (or of its host's agent
    socket in ``agents``, host -> address)."""
    import asyncio

    import grpc

    from paramplane.node.coord_client import CoordinatorClient

    # One connection per simulated rank, as a rank process has: grpc would otherwise share one between the
    # channels of this process, and HTTP/2's limit of concurrent streams would queue heartbeats behind waits.
    plain_channel = grpc.aio.insecure_channel

    def own_connection(target: str, options: Any = None, *args: Any, **kw: Any) -> Any:
        return plain_channel(target, [*(options or []), ("grpc.use_local_subchannel_pool", 1)], *args, **kw)

    grpc.aio.insecure_channel = own_connection
    ranks = _my_ranks(n, hosts, procs, index)
    per_host = n // hosts
    clients = {
        r: CoordinatorClient(agents[h] if agents else address, call_timeout_s=TIMEOUT_S) for r, h in ranks
    }
    await asyncio.get_running_loop().run_in_executor(None, _ready_then_go)
    out = new_out(rounds)
    silent = n - 1  # the rank that stops heartbeating at the end
    stop_beats = asyncio.Event()

    async def beat(r: int, client: CoordinatorClient) -> None:
        interval = client.membership.heartbeat_interval_s if client.membership else 1.0
        issued = 0
        while not (r == silent and stop_beats.is_set()):
            issued += 1  # a collective per beat, completed: progress as a training rank reports it
            await client.heartbeat({"world": (issued, issued)})
            await asyncio.sleep(interval)

    async def watch(client: CoordinatorClient) -> None:
        async for event in client.watch():
            if event.kind == "abort":
                out["abort"].append(time.monotonic())
                return

    async def rank(r: int, host: int) -> None:
        client = clients[r]
        t0 = time.monotonic()
        await client.join(
            host_id=f"sim-host-{host}",
            peer_address=f"10.0.{host}.{r % per_host}:7000",
            instance_id=f"sim-{r}",
            rank_hint=r,
            world_size=n,
            timeout_s=TIMEOUT_S,
        )
        out["join"].append((t0, time.monotonic()))
        tasks.append(asyncio.ensure_future(beat(r, client)))
        tasks.append(asyncio.ensure_future(watch(client)))
        for op, name in plan(r, host, per_host, rounds, out):
            if op == "barrier":
                await client.barrier(name, timeout_s=TIMEOUT_S)
            elif op == "set":
                await client.kv_set(name, UID)
            else:
                await client.kv_get(name, wait=True, timeout_s=TIMEOUT_S)

    tasks: list[asyncio.Future[Any]] = []
    await asyncio.gather(*(rank(r, h) for r, h in ranks))
    out["steady"] = (time.monotonic(), time.monotonic() + steady_s)
    await asyncio.sleep(steady_s)  # the steady window: heartbeats and watches only
    out["stop"] = time.monotonic()
    stop_beats.set()
    watches = [t for i, t in enumerate(tasks) if i % 2 == 1]
    alive = [w for (r, _), w in zip(ranks, watches) if r != silent]
    await asyncio.wait_for(asyncio.gather(*alive, return_exceptions=True), TIMEOUT_S)
    for t in tasks:
        t.cancel()
    for client in clients.values():
        await client.close()
    return out


# -- TCPStore simulator -----------------------------------------------------------------------------------------
def _sim_tcpstore(
    port: int, n: int, hosts: int, procs: int, index: int, rounds: int = ROUNDS
) -> dict[str, Any]:
    from datetime import timedelta

    from torch.distributed import TCPStore

    ranks = _my_ranks(n, hosts, procs, index)
    per_host = n // hosts
    out = new_out(rounds)
    errors: list[BaseException] = []

    def rank(r: int, host: int) -> None:
        try:
            t0 = time.monotonic()
            store = TCPStore("127.0.0.1", port, n, False, timeout=timedelta(seconds=TIMEOUT_S))
            if store.add("joined", 1) == n:
                store.set("formed", "1")
            store.wait(["formed"])
            out["join"].append((t0, time.monotonic()))
            for op, name in plan(r, host, per_host, rounds, out):
                if op == "barrier":
                    if store.add(name, 1) == n:
                        store.set(f"{name}/done", "1")
                    store.wait([f"{name}/done"])
                elif op == "set":
                    store.set(name, UID.decode())
                else:
                    store.get(name)
        except BaseException as e:  # reported by the parent
            errors.append(e)

    threads = [threading.Thread(target=rank, args=rh, daemon=True) for rh in ranks]
    _ready_then_go()
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    if errors:
        raise RuntimeError(f"{len(errors)} TCPStore ranks failed, first: {errors[0]!r}")
    return out


def _store_server(n: int, port_file: str) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, n, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False, use_libuv=True
    )
    Path(port_file).write_text(str(store.port))
    while True:
        time.sleep(3600)


# -- the parent -------------------------------------------------------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class _Sampler(threading.Thread):
    """(time, cpu seconds, rss MB) of a process every 0.25 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.samples.append((time.monotonic(), _cpu_seconds(self.pid), _rss_mb(self.pid)))
            except OSError:
                return
            self.done.wait(0.25)

    def window(self, start: float, end: float) -> tuple[float, float]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan"), float("nan")
        (t0, c0, _), (t1, c1, _) = inside[0], inside[-1]
        return (c1 - c0) / (t1 - t0), max(s[2] for s in inside)


def _wait_file(path: Path, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return path.read_text().strip()


def _run_sims(
    impl: str, target: str, n: int, hosts: int, procs: int, steady_s: float, rounds: int
) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--sim", impl, "--target", target, "--n", str(n), "--hosts", str(hosts),
           "--procs", str(procs), "--steady", str(steady_s), "--rounds", str(rounds)]  # fmt: skip
    sims = [
        subprocess.Popen([*cmd, "--index", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for i in range(procs)
    ]
    results = []
    try:
        for p in sims:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{impl} simulator failed to start")
        for p in sims:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in sims:
            stdout, _ = p.communicate(timeout=TIMEOUT_S * 2)
            if p.returncode != 0:
                raise RuntimeError(f"{impl} simulator exited with {p.returncode}")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in sims:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _summary(impl: str, n: int, hosts: int, procs: int, parts: list[dict[str, Any]]) -> dict[str, Any]:
    row = {"bench": "control_plane", "impl": impl, "world_size": n, "hosts": hosts, "sim_processes": procs}
    return {**row, **summary(parts)}


def _measure(
    impl: str, n: int, heartbeat_timeout_s: float, steady_s: float = STEADY_S, rounds: int = ROUNDS
) -> dict[str, Any]:
    hosts = _hosts_for(n)
    procs = _procs_for(n, hosts)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pp-cp-") as tmp:
        port_file = Path(tmp) / "port"
        if impl != "tcpstore":
            server = subprocess.Popen(
                [sys.executable, "-m", "paramplane.cli", "coordinator", "--world-size", str(n), "--port", "0",
                 "--port-file", str(port_file), "--heartbeat-timeout", str(heartbeat_timeout_s)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        else:
            server = subprocess.Popen(
                [sys.executable, __file__, "--store-server", str(port_file), "--n", str(n)]
            )
        try:
            target = f"127.0.0.1:{_wait_file(port_file, server)}"
            sampler = _Sampler(server.pid)
            sampler.start()
            parts = _run_sims(impl, target, n, hosts, procs, steady_s, rounds)
            sampler.done.set()
            row = _summary(_ROW_NAMES.get(impl, impl), n, hosts, procs, parts)
            if impl != "tcpstore":
                start, end = max(p["steady"][0] for p in parts), min(p["steady"][1] for p in parts)
                row["cpu_steady"], row["rss_mb"] = sampler.window(start + 1.0, end)
                stop = parts[(hosts - 1) % procs]["stop"]  # the process of rank n - 1, the silent one
                aborts = [a for p in parts for a in p["abort"]]
                row["detect_s"] = max(aborts) - stop if len(aborts) >= n - 1 else None
                row["heartbeat_timeout_s"] = heartbeat_timeout_s
            else:
                row["rss_mb"] = max(s[2] for s in sampler.samples)
            row["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]  # before, after
        finally:
            server.kill()
            server.wait()
    return row


_ROW_NAMES = {"agent": "paramplane-agent", "agent-hop": "paramplane-agent-hop"}


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [("join_s", "join (s)"), ("barrier_s", "barrier after last arrival (s)"),
               ("uid_world_s", "unique id, world group (s)"), ("uid_host_s", "unique id, a group per host (s)"),
               ("cpu_steady", "coordinator CPU, steady (cores)"), ("rss_mb", "server memory (MB)")]  # fmt: skip
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title) in zip(axes.flat, figures):
        styles = (("paramplane", "o-"), ("paramplane-agent", "^-"), ("paramplane-agent-hop", "v:"),
                  ("tcpstore", "s--"))  # fmt: skip
        for impl, style in styles:
            pts = sorted(
                (r["world_size"], r[key]) for r in rows if r["impl"] == impl and r.get(key) is not None
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["paramplane", "agent", "tcpstore"],
        choices=["paramplane", "agent", "agent-hop", "tcpstore"],
        help="paramplane: every rank calls the coordinator; agent: through one host agent per host, the ranks "
        "calling its methods in process; agent-hop: the same with each rank a client of its agent's Unix socket",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="the coordinator's (default 10, its own default); a loaded host may need more for its simulators",
    )
    parser.add_argument("--steady", type=float, default=STEADY_S, help="seconds of the steady window")
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="measured rounds after the first (figures: their median)"
    )
    parser.add_argument("--tcpstore-max", type=int, default=4096, help="largest world size run on TCPStore")
    parser.add_argument("--plot", type=Path, help="draw the log-log figure of --out's rows here")
    parser.add_argument("--plot-only", action="store_true", help="only draw --plot from the rows in --out")
    parser.add_argument(
        "--sim", choices=["paramplane", "agent", "agent-hop", "tcpstore"], help=argparse.SUPPRESS
    )
    parser.add_argument("--store-server", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--procs", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.store_server:
        _store_server(args.n, args.store_server)
        return 0
    if args.sim == "paramplane":
        import asyncio

        result = asyncio.run(
            _sim_paramplane(args.target, args.n, args.hosts, args.procs, args.index, args.steady, args.rounds)
        )
        print(json.dumps(result), flush=True)
        return 0
    if args.sim == "agent-hop":
        import asyncio

        from paramplane.benchmarks._control_plane_agent import sim_agents_hop

        result = asyncio.run(
            sim_agents_hop(args.target, args.n, args.hosts, args.procs, args.index, args.steady, args.rounds)
        )
        print(json.dumps(result), flush=True)
        return 0
    if args.sim == "agent":
        import asyncio

        from paramplane.benchmarks._control_plane_agent import sim_agents

        mine = _my_ranks(args.n, args.hosts, args.procs, args.index)
        result = asyncio.run(
            sim_agents(
                args.target,
                args.n,
                mine,
                args.n // args.hosts,
                _ready_then_go,
                args.steady,
                TIMEOUT_S,
                UID,
                args.rounds,
            )
        )
        print(json.dumps(result), flush=True)
        return 0
    if args.sim == "tcpstore":
        port = int(args.target.rsplit(":", 1)[1])
        result = _sim_tcpstore(port, args.n, args.hosts, args.procs, args.index, args.rounds)
        print(json.dumps(result), flush=True)
        return 0
    if args.plot_only:
        args.sizes = []
    for n in args.sizes:
        for impl in args.impls:
            if impl == "tcpstore" and n > args.tcpstore_max:
                continue
            row = _measure(impl, n, args.heartbeat_timeout, args.steady, args.rounds)
            emit([json.dumps(row)], args.out)
    if args.plot and args.out:
        rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
        _plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
