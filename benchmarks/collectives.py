"""Collective bandwidth and latency: paramplane (lanes, shm, gRPC streams) beside torch.distributed gloo,
nccl-tests style.

Every implementation runs at its own defaults: paramplane ranks get the launcher's malloc settings
(MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_), gloo and the bare socket ring get none. Transports
(``PARAMPLANE_TRANSPORT=grpc`` but ``shm``): ``lane-tcp`` is paramplane's inter-host path (frames on raw
TCP lanes, ``PARAMPLANE_UNIX_LANE=0``), ``lane-unix`` the same on Unix sockets (the default between ranks
of one host when shm is off), ``grpc-stream`` the same frames on gRPC streams (what TLS uses,
``PARAMPLANE_TCP_LANE=0``), ``shm`` shared memory (the default on one host); ``rawtcp`` is a two-process
socket ring all-reduce, the physical limit of loopback plus add.

For every (impl, transport, world size) a fresh world of rank processes is started on this host; each
rank times every call of every (op, size) and takes the median of its per-iteration times; rank 0
gathers the ranks' medians through the group and reports the largest. ``bytes`` is the whole buffer
as nccl-tests counts it: the all-reduce / broadcast array, the all-gather output, the reduce-scatter
input, the all-to-all input (float32). algbw = bytes / p50, busbw = algbw * (all_reduce 2(n-1)/n, all_gather,
reduce_scatter and all_to_all (n-1)/n, broadcast 1). ``all_to_all_skewed`` is an all_to_all with split sizes
as a mixture of experts routes tokens to one popular expert: every rank sends half its rows to rank 0 and
the rest evenly (``skewed_splits``; torch's ``all_to_all_single`` with ``input_split_sizes`` /
``output_split_sizes``, paramplane's ``in_splits`` / ``out_splits``).

Small messages are timed two ways (sizes up to ``latency_bytes``): ``hot_p50_us`` back to back (the
calls of ``p50_us``) and ``cold_p50_us`` each call issued right after a barrier, as after a compute
step, when every thread of the plane has gone to sleep. With ``--repeats R`` every world is started R
times, rounds interleaved (ours, then the peers, then ours again), and each number is the median of
its rounds. Output: JSON lines (stdout and ``--out``), then one summary line per paramplane row with
ratios against gloo at the same (op, world, bytes).

Run: ``python benchmarks/collectives.py [--quick] [--markdown] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paramplane.launch import MALLOC_DEFAULTS
from paramplane.local_world import run_world

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "all_to_all_skewed")
TRANSPORTS = ("lane-unix", "lane-tcp", "shm", "grpc-stream")
DEFAULT_TRANSPORTS = TRANSPORTS
ALIASES = {"grpc": "lane-tcp", "grpc-streams": "grpc-stream"}  # the names of earlier runs
DEFAULT_SIZES = tuple(4096 * 4**i for i in range(8))  # 4 KiB .. 64 MiB
QUICK_SIZES = (4096, 65536)
MALLOC_ENV = MALLOC_DEFAULTS  # the launcher's, for paramplane ranks only
ITEMSIZE = 4  # float32


@dataclass
class BenchConfig:
    """What one run measures."""

    ops: tuple[str, ...] = OPS
    """Collectives to time (subset of OPS)."""
    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Buffer sizes in bytes (nccl-tests convention, see the module docstring)."""
    worlds: tuple[int, ...] = (2, 4)
    """World sizes; each gets fresh rank processes per impl and transport."""
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    """paramplane transports to time: lane-unix, lane-tcp (frames on raw Unix / TCP sockets; TCP is the
    default between hosts), shm (the default on one host), grpc-stream (the frames on gRPC streams, as
    under TLS)."""
    gloo: bool = True
    """Also time torch.distributed gloo (skipped with a note when torch is not importable)."""
    torch_backend: bool = False
    """Also time the same ``torch.distributed`` calls as gloo's over paramplane (``pp.init_torch_distributed``;
    rows say ``paramplane-torch``), on each of ``transports``: the backend's cost over paramplane's own calls."""
    rawtcp: bool = True
    """Also time a bare two-process socket ring all-reduce (world 2 only): the loopback-plus-add limit."""
    iters: int | None = None
    """Timed iterations for every size; None scales them with the size (fewer at large sizes)."""
    byte_budget: int = 1 << 30
    """With ``iters`` None: bytes moved per (op, size) at world 2, halved per doubling of the world."""
    max_iters: int = 200
    """With ``iters`` None: the most timed iterations of one (op, size)."""
    min_iters: int = 8
    """With ``iters`` None: the fewest timed iterations of one (op, size)."""
    timeout_s: float = 600.0
    """Deadline for one world (start to exit of all its ranks)."""
    repeats: int = 1
    """Rounds over every world and impl (interleaved, so load drifts hit all alike); the median round counts."""
    latency_bytes: int = 64 << 10
    """Sizes up to this are also timed cold (each call right after a barrier): ``cold_p50_us``."""

    def __post_init__(self) -> None:
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of {OPS}, got {list(self.ops)}")
        bad = [t for t in self.transports if t not in TRANSPORTS]
        if bad:
            raise ValueError(f"transports must be a subset of {TRANSPORTS}, got {list(self.transports)}")
        if not self.sizes or any(s < ITEMSIZE * 4 for s in self.sizes):
            raise ValueError(f"sizes must be non-empty and each at least {ITEMSIZE * 4} bytes")
        if not self.worlds or any(w < 2 for w in self.worlds):
            raise ValueError(f"world sizes must be >= 2, got {list(self.worlds)}")
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if not 1 <= self.min_iters <= self.max_iters:
            raise ValueError("need 1 <= min_iters <= max_iters")
        if self.timeout_s <= 0 or self.byte_budget <= 0 or self.repeats < 1 or self.latency_bytes < 0:
            raise ValueError("timeout_s and byte_budget must be > 0, repeats >= 1, latency_bytes >= 0")

    def schedule(self, nbytes: int, world: int) -> tuple[int, int]:
        """(warm-up, timed) iterations for one (op, size) in a world of ``world`` ranks."""
        if self.iters is not None:
            return max(1, min(5, self.iters // 5)), self.iters
        budget = self.byte_budget * 2 // world
        timed = max(self.min_iters, min(self.max_iters, budget // nbytes))
        return max(2, min(10, timed // 10)), timed


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` over ``n`` ranks (nccl-tests PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_skewed"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def _sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def make_row(
    impl: str,
    transport: str,
    op: str,
    world: int,
    nbytes: int,
    p50_s: float,
    iters: int,
    cold_p50_s: float | None = None,
) -> dict[str, Any]:
    """One (impl, transport, op, world, bytes) case; ``cold_p50_s`` adds the cold and hot latencies."""
    algbw = nbytes / p50_s / 1e9
    cold = (
        {} if cold_p50_s is None else {"cold_p50_us": _sig(cold_p50_s * 1e6), "hot_p50_us": _sig(p50_s * 1e6)}
    )
    return {
        "bench": "collectives",
        "impl": impl,
        "transport": transport,
        "op": op,
        "world_size": world,
        "bytes": nbytes,
        "p50_us": _sig(p50_s * 1e6),
        "algbw_GBps": _sig(algbw),
        "busbw_GBps": _sig(algbw * bus_factor(op, world)),
        "iters": iters,
        **cold,
    }


# -- rank side -----------------------------------------------------------------------------------
def _time_calls(call: Callable[[], object], warmup: int, timed: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_cold(call: Callable[[], object], barrier: Callable[[], object], timed: int) -> float:
    """The median time of ``call`` issued right after a barrier (the plane's threads asleep, as after a
    compute step)."""
    times = []
    for _ in range(timed):
        barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def skewed_splits(count: int, n: int) -> list[int]:
    """The rows every rank sends to each rank in ``all_to_all_skewed``: half of its ``count`` to rank 0, the rest
    evenly over all ``n`` ranks (rank 0 then receives ``n`` times its share plus half of everything)."""
    even = count // 2 // n
    splits = [even] * n
    splits[0] += count - even * n
    return splits


def _paramplane_call(g: Any, op: str, x: Any) -> Callable[[], object]:
    """Like gloo's ``*_single`` calls, all_gather and reduce_scatter write into a preallocated ``out``."""
    import numpy as np

    if op == "broadcast":
        return lambda: g.broadcast(x, src=0)
    if op == "all_gather":
        gathered = np.empty(x.size * g.size, x.dtype)
        return lambda: g.all_gather(x, out=gathered)
    if op == "reduce_scatter":
        base, extra = divmod(x.size, g.size)
        piece = np.empty(base + (1 if g.rank < extra else 0), x.dtype)
        return lambda: g.reduce_scatter(x, out=piece)
    if op == "all_to_all":
        exchanged = np.empty_like(x)
        return lambda: g.all_to_all(x, out=exchanged)
    if op == "all_to_all_skewed":
        splits = skewed_splits(x.size, g.size)
        receives = [splits[g.rank]] * g.size
        got = np.empty(sum(receives), x.dtype)
        return lambda: g.all_to_all(x, out=got, in_splits=splits, out_splits=receives)
    return lambda: g.all_reduce(x)


def _gloo_call(op: str, big: Any, small: Any) -> Callable[[], object]:
    """``big`` holds ``bytes`` (the all-gather output, the reduce-scatter input), ``small`` 1/n of it."""
    import torch.distributed as dist

    if op == "all_reduce":
        return lambda: dist.all_reduce(big)
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(big, small)
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(small, big)
    if op == "all_to_all":
        exchanged = big.clone()
        return lambda: dist.all_to_all_single(exchanged, big)
    if op == "all_to_all_skewed":
        n, rank = dist.get_world_size(), dist.get_rank()
        splits = skewed_splits(big.numel(), n)
        receives = [splits[rank]] * n
        got = big.new_empty(sum(receives))
        return lambda: dist.all_to_all_single(got, big, receives, splits)
    return lambda: dist.broadcast(big, src=0)


def _rank_loop(
    cfg: BenchConfig,
    impl: str,
    transport: str,
    n: int,
    make_call: Callable[[str, int], Callable[[], object]],
    barrier: Callable[[], object],
    worst: Callable[[float], float],
) -> list[dict[str, Any]]:
    """Time every (op, size); ``make_call(op, count)`` builds the call, ``worst`` maxes over ranks."""
    rows = []
    for op in cfg.ops:
        for size in cfg.sizes:
            count = size // ITEMSIZE // n * n
            warmup, timed = cfg.schedule(size, n)
            call = make_call(op, count)
            barrier()
            p50 = worst(_time_calls(call, warmup, timed))
            cold = worst(_time_cold(call, barrier, timed)) if size <= cfg.latency_bytes else None
            rows.append(make_row(impl, transport, op, n, count * ITEMSIZE, p50, timed, cold))
    return rows


def _paramplane_rank(cfg: BenchConfig, transport: str, out: Path) -> None:
    import numpy as np

    import paramplane as pp

    world = pp.init()
    g = world.group

    def make_call(op: str, count: int) -> Callable[[], object]:
        return _paramplane_call(g, op, np.zeros(count // g.size if op == "all_gather" else count, np.float32))

    def worst(median: float) -> float:
        return float(g.all_gather(np.array([median], np.float64)).max())

    rows = _rank_loop(cfg, "paramplane", transport, g.size, make_call, g.barrier, worst)
    if world.rank == 0:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    world.shutdown()


def _torch_dist_rank(
    cfg: BenchConfig, rank: int, n: int, store: str, out: Path, impl: str = "gloo", transport: str = "gloo"
) -> None:
    """torch.distributed's calls over gloo, or (``impl`` "paramplane-torch") over paramplane's backend on
    ``transport``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=cfg.timeout_s)
    world = None
    if impl == "gloo":
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=n, timeout=timeout
        )
    else:
        import paramplane as pp

        world = pp.init()
        pp.init_torch_distributed(world, timeout=timeout)
        rank = world.rank

    def make_call(op: str, count: int) -> Callable[[], object]:
        return _gloo_call(op, torch.zeros(count), torch.zeros(count // n))

    def worst(median: float) -> float:
        t = torch.tensor([median], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    rows = _rank_loop(cfg, impl, transport, n, make_call, dist.barrier, worst)
    if rank == 0:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.destroy_process_group()
    if world is not None:
        world.shutdown()


def _worker(spec: dict[str, Any]) -> None:
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["config"].items()}
    cfg = BenchConfig(**fields)
    out = Path(spec["out"])
    if spec["impl"] in ("gloo", "paramplane-torch"):
        _torch_dist_rank(
            cfg, spec["rank"], spec["world"], spec["store"], out, spec["impl"], spec["transport"]
        )
    elif spec["impl"] == "rawtcp":
        _rawtcp_rank(cfg, spec["rank"], spec["store"], out)
    else:
        _paramplane_rank(cfg, spec["transport"], out)


def _rawtcp_rank(cfg: BenchConfig, rank: int, store: str, out: Path) -> None:
    """Two processes, one socket: a ring all-reduce (send half, receive and add the other half, swap
    the sums) with a sender thread and 1 MiB receives into a reused buffer. No framing, no checks."""
    import socket
    import threading

    import numpy as np

    port_file = Path(f"{store}.port")
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", 0))
        port_file.write_text(str(listener.getsockname()[1]))
        sock, _ = listener.accept()
        listener.close()
    else:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError("rank 0 never published its port")
            time.sleep(0.01)
        sock = socket.create_connection(("127.0.0.1", int(port_file.read_text())))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    chunk = np.empty(1 << 18, np.float32)  # 1 MiB

    def exchange(send: np.ndarray, into: np.ndarray, add: bool) -> None:
        sender = threading.Thread(target=sock.sendall, args=(send.view(np.uint8).data,))
        sender.start()
        done = 0
        while done < into.size:
            m = min(chunk.size, into.size - done)
            view = chunk[:m].view(np.uint8).data
            got = 0
            while got < view.nbytes:
                got += sock.recv_into(view[got:])
            if add:
                np.add(into[done : done + m], chunk[:m], out=into[done : done + m])
            else:
                into[done : done + m] = chunk[:m]
            done += m
        sender.join()

    def make_call(op: str, count: int) -> Callable[[], object]:
        x = np.zeros(count, np.float32)
        half = count // 2
        mine, theirs = (x[:half], x[half:]) if rank == 0 else (x[half:], x[:half])

        def all_reduce() -> None:
            exchange(theirs, mine, add=True)
            exchange(mine, theirs, add=False)

        return all_reduce

    def barrier() -> None:
        sock.sendall(b"b")
        assert sock.recv(1) == b"b"

    def worst(median: float) -> float:
        sock.sendall(np.array([median], np.float64).tobytes())
        other = np.frombuffer(sock.recv(8, socket.MSG_WAITALL), np.float64)[0]
        return max(median, float(other))

    rows = _rank_loop(
        dataclasses.replace(cfg, ops=("all_reduce",)), "rawtcp", "rawtcp", 2, make_call, barrier, worst
    )
    if rank == 0:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sock.close()


# -- driver side ---------------------------------------------------------------------------------
def torch_available() -> bool:
    """Whether torch is installed (found without importing it: the ranks import it)."""
    return importlib.util.find_spec("torch") is not None


def _run_world(cfg: BenchConfig, impl: str, transport: str, world: int) -> list[dict[str, Any]]:
    """Start ``world`` rank processes for one impl/transport (``run_world``), return rank 0's rows."""
    # Our launcher's malloc defaults for our ranks only (a MALLOC_* set here wins, as with the launcher): a peer
    # runs at its own defaults.
    env = dict(os.environ)
    ours = impl in ("paramplane", "paramplane-torch")
    for key, value in MALLOC_ENV.items():
        if ours:
            env.setdefault(key, value)
        else:
            env.pop(key, None)
    if ours:
        env.update(
            PARAMPLANE_TRANSPORT="shm" if transport == "shm" else "grpc",
            PARAMPLANE_TCP_LANE="0" if transport == "grpc-stream" else "1",
            # lane-tcp stands for the inter-host path: loopback TCP, not a same-machine socket.
            PARAMPLANE_UNIX_LANE="1" if transport == "lane-unix" else "0",
            PARAMPLANE_TIMEOUT=str(cfg.timeout_s),
        )
    else:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    with tempfile.TemporaryDirectory(prefix="pp-bench-") as tmp:
        out = Path(tmp) / "rows.jsonl"

        def command(rank: int) -> list[str]:
            spec = dict(impl=impl, transport=transport, rank=rank, world=world, store=f"{tmp}/store")
            spec.update(out=str(out), config=asdict(cfg))
            return [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]

        run = run_world(world, command, env=env, timeout_s=cfg.timeout_s, coordinator=ours)
        failed = [r for r in run.ranks if r.returncode != 0]
        if failed or run.timed_out:
            raise RuntimeError(
                f"{impl}/{transport} world {world}: ranks {[r.rank for r in failed]} failed or passed "
                f"{cfg.timeout_s:.0f}s (codes {[r.returncode for r in run.ranks]}); last output of rank "
                f"{failed[0].rank if failed else 0}:\n{(failed or run.ranks)[0].output[-1500:]}"
            )
        return [json.loads(line) for line in out.read_text().splitlines()]


def combine(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per case, the round with the median p50 (the lower one of an even count), tagged with ``repeats``; the
    cold and hot latencies are each the median (the lower one of an even count) of their rounds."""
    cases: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for rows in rounds:
        for r in rows:
            cases.setdefault((r["impl"], r["transport"], r["op"], r["world_size"], r["bytes"]), []).append(r)
    out = []
    for runs in cases.values():
        mid = dict(sorted(runs, key=lambda r: r["p50_us"])[(len(runs) - 1) // 2], repeats=len(runs))
        for key in ("cold_p50_us", "hot_p50_us"):
            values = sorted(r[key] for r in runs if key in r)
            if values:
                mid[key] = values[(len(values) - 1) // 2]
                mid[key.replace("_p50_us", "_rounds_us")] = [r[key] for r in runs if key in r]
        out.append(mid)
    return out


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per paramplane row with a gloo row at the same (op, world, bytes).

    busbw_vs_gloo > 1 and p50_vs_gloo < 1 mean paramplane is faster.
    """
    gloo = {(r["op"], r["world_size"], r["bytes"]): r for r in rows if r["impl"] == "gloo"}
    raw = {(r["op"], r["world_size"], r["bytes"]): r for r in rows if r["impl"] == "rawtcp"}
    out = []
    for r in rows:
        at = (r["op"], r["world_size"], r["bytes"])
        ref = gloo.get(at)
        if r["impl"] not in ("paramplane", "paramplane-torch") or ref is None:
            continue
        line = {
            "bench": "collectives_summary",
            **{k: r[k] for k in ("impl", "transport", "op", "world_size", "bytes")},
        }
        line["busbw_vs_gloo"] = _sig(r["busbw_GBps"] / ref["busbw_GBps"], 3)
        line["p50_vs_gloo"] = _sig(r["p50_us"] / ref["p50_us"], 3)
        for key in ("cold_p50_us", "hot_p50_us"):
            if key in r and key in ref:
                line[key.replace("_us", "_vs_gloo")] = _sig(r[key] / ref[key], 3)
        if at in raw:  # against the bare socket ring: the loopback-plus-add limit
            line["busbw_vs_rawtcp"] = _sig(r["busbw_GBps"] / raw[at]["busbw_GBps"], 3)
        out.append(line)
    return out


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Tables per (op, world): busbw in GB/s and p50 in µs for every impl/transport column."""
    cols = sorted({r["transport"] for r in rows}, key=lambda t: (t == "gloo", t))
    cell = {(r["op"], r["world_size"], r["bytes"], r["transport"]): r for r in rows}
    lines = []
    for op in OPS:
        for world in sorted({r["world_size"] for r in rows if r["op"] == op}):
            sizes = sorted({r["bytes"] for r in rows if r["op"] == op and r["world_size"] == world})
            lines += [f"\n**{op}, world {world}** — busbw GB/s / p50 µs\n"]
            lines += ["| bytes | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
            for size in sizes:
                vals = []
                for t in cols:
                    r = cell.get((op, world, size, t))
                    vals.append(f"{r['busbw_GBps']:.3f} / {r['p50_us']:.0f}" if r else "—")
                lines.append(f"| {_fmt_bytes(size)} | " + " | ".join(vals) + " |")
    return "\n".join(lines).lstrip("\n") + "\n"


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(kind(v.strip()) for v in text.split(",") if v.strip())

    return parse


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="paramplane bench collectives", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--ops", type=_csv(str), default=OPS, help="comma list (default: all six)")
    p.add_argument("--sizes", type=_csv(_size), default=None, help="e.g. 4K,1M,64M (default 4K..64M)")
    p.add_argument("--worlds", type=_csv(int), default=(2, 4), help="comma list of world sizes (default 2,4)")
    p.add_argument(
        "--transports",
        type=_csv(str),
        default=DEFAULT_TRANSPORTS,
        help="comma list (default lane-unix,lane-tcp,shm,grpc-stream)",
    )
    p.add_argument(
        "--latency-bytes",
        type=_size,
        default=64 << 10,
        help="sizes up to this are also timed cold, each call after a barrier (default 64K)",
    )
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: by size)")
    p.add_argument(
        "--repeats", type=int, default=None, help="interleaved rounds, median kept (default 1; --latency 5)"
    )
    p.add_argument("--no-gloo", action="store_true", help="skip torch.distributed gloo")
    p.add_argument(
        "--torch-backend",
        action="store_true",
        help="also time the torch.distributed calls over paramplane (pp.init_torch_distributed)",
    )
    p.add_argument("--no-rawtcp", action="store_true", help="skip the bare socket all_reduce (world 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per world (default 600)")
    p.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    p.add_argument("--quick", action="store_true", help="world 2, 4K and 64K, 5 iters")
    p.add_argument(
        "--latency",
        action="store_true",
        help="small-message latency: world 2 all_reduce at 4K, 300 calls, 5 rounds",
    )
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick, latency = args.quick, args.latency
    iters = args.iters if args.iters is not None else (5 if quick else 300 if latency else None)
    try:
        cfg = BenchConfig(
            ops=("all_reduce",) if latency else args.ops,
            sizes=args.sizes or (QUICK_SIZES if quick else (4096,) if latency else DEFAULT_SIZES),
            worlds=(2,) if quick or latency else args.worlds,
            transports=tuple(ALIASES.get(t, t) for t in args.transports),
            latency_bytes=args.latency_bytes,
            gloo=not args.no_gloo,
            torch_backend=args.torch_backend,
            rawtcp=not args.no_rawtcp,
            iters=iters,
            timeout_s=min(args.timeout, 60.0) if quick else args.timeout,
            repeats=args.repeats if args.repeats is not None else (5 if latency else 1),
        )
    except ValueError as exc:
        p.error(str(exc))
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    impls = [("paramplane", t) for t in cfg.transports]
    if cfg.torch_backend and torch_available():
        impls += [("paramplane-torch", t) for t in cfg.transports]
    if cfg.rawtcp and "all_reduce" in cfg.ops and 2 in cfg.worlds:
        impls.append(("rawtcp", "rawtcp"))
    if cfg.gloo:
        if torch_available():
            impls.append(("gloo", "gloo"))
        else:
            print("torch.distributed not importable: gloo peer skipped", file=sys.stderr)
    rounds: list[list[dict[str, Any]]] = []
    try:
        for i in range(cfg.repeats):
            rounds.append([])
            for world in cfg.worlds:
                # Every other round in reverse order: ours and the peers alternate, load drifts hit all alike.
                for impl, transport in impls if i % 2 == 0 else impls[::-1]:
                    if impl == "rawtcp" and world != 2:
                        continue
                    start = time.monotonic()
                    rounds[-1] += _run_world(cfg, impl, transport, world)
                    took = time.monotonic() - start
                    print(f"# round {i + 1}: {impl}/{transport} world {world}: {took:.1f}s", file=sys.stderr)
    except RuntimeError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    rows = combine(rounds)
    lines = [json.dumps(line) for line in [*rows, *summarize(rows)]]
    print("\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "a") as sink:
            sink.write("".join(line + "\n" for line in lines))
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
