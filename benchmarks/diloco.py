"""DiLoCo across a slow link: HybridShard every step vs DiLoCo H=10, H=50 and Streaming DiLoCo, two hosts.

    sudo .venv/bin/python benchmarks/diloco.py [--steps 800] [--batch 1] [--links 100mbit,1gbit]
        [--out benchmarks/results/diloco.jsonl] [--plot benchmarks/results/diloco.png]
    .venv/bin/python benchmarks/diloco.py --no-netns --steps 4 --dim 32 --layers 1 ...   # no link (smoke)

Two hosts are two network namespaces (``ppdl-<pid>-a`` / ``-b``) joined by a veth pair whose both ends are
shaped with ``tc qdisc ... netem rate <R> delay 10ms`` (R = 100 Mbit/s, then 1 Gbit/s): 10 ms each way. Each
host runs 2 ranks (the coordinator lives on host A); inside a host the ranks talk over shared memory, across
hosts over TCP through the veth. The namespaces are deleted at the end, also on failure.

The model is the project's small GPT (``examples/train_gpt.py``'s ``TinyGPT``: ``--dim 192 --layers 3``, 4
heads, tied embedding, context 64: 1.4M parameters) learning a character-level language model (ASCII, 128
symbols) of the Python standard library's own source files (the ``*.py`` under ``sysconfig``'s stdlib path,
sorted; the last 5% of the text is the validation set). Every rank draws ``--batch`` windows of the training
text from (step, rank): every variant sees the same tokens. One BLAS thread per rank; AdamW (lr 2e-3) inside.

The defaults (1 window per rank and step, 800 steps: 256 tokens a step, 204,800 in all) put the link, not
the CPU, on HybridShard's critical path as in the issue's scenario (GPU hosts across a slow link): a step's
CPU time is about 0.1 s per rank while HybridShard's 5.5 MB each way per step take 0.44 s at 100 Mbit/s
(``cpu_s_per_step``, ``link_bytes_per_step``). With 4 windows a step (the earlier default, 200 steps) a
step's CPU time on a busy 2-core machine exceeded the link's and every variant was CPU-bound.

Variants (every one at equal tokens: ``--steps`` inner steps of 4 x ``--batch`` x 64 tokens):

- ``hybrid_shard``: ``pp.FSDP(model, world.group, "hybrid_shard")``: shards inside a host, the gradient shards
  all-reduced across the hosts every step (float32, the default).
- ``diloco_h10`` / ``diloco_h50``: ``pp.FSDP(..., mesh.group("shard"), "full_shard")`` inside each host,
  ``pp.DiLoCo(..., mesh.group("replicate"), sync_every=H)`` across (outer Nesterov SGD lr 0.7, momentum 0.9).
- ``streaming_h40``: the same with ``fragments=4, overlap=True, outer_dtype="int8"`` and H = 40 (``fragments``
  must divide H, and 40 divides the 800 steps): one fragment (an FSDP unit) synced every 10 steps.
- ``streaming_h40_avg``: ``streaming_h40`` with plain averaging as the outer step (``torch.optim.SGD`` lr 1,
  no momentum) instead of DiLoCo's default Nesterov SGD (lr 0.7, momentum 0.9).
- Not in the default ``--variants``: ``streaming_h40_f32`` (no int8) and ``streaming_h40_no_overlap``;
  ``--outer-lr``/``--outer-momentum`` and ``--alpha`` override the outer optimizer and DiLoCo's ``alpha``
  of every DiLoCo variant (ablations). At the end every DiLoCo variant calls ``diloco.sync_all()`` before
  its final evaluation (``final_val_loss_before_sync_all``: the one before it).

Measured per variant and link: bytes crossing the link per step (rank 0 reads the veth's ``tx_bytes`` +
``rx_bytes`` before and after the training steps: payload, TCP/IP headers and heartbeats), the training wall
time (rank 0's, validation excluded), the validation loss of rank 0's model every ``--eval-every`` steps
(between syncs that is host A's replica) and at the end (after a final sync), and the wall time to a target
validation loss: ``1.03 x`` HybridShard's final validation loss on the same link (first evaluation at or
below it). Ratios against HybridShard on the same link. One JSON line per variant and link.

The coordinator runs with ``--heartbeat-timeout 120``: on a busy shared machine a starved rank can miss
the default 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.benchmarks._jsonl import emit

VARIANTS: dict[str, dict[str, Any]] = {
    "hybrid_shard": {},
    "diloco_h10": {"sync_every": 10},
    "diloco_h50": {"sync_every": 50},
    "streaming_h40": {"sync_every": 40, "fragments": 4, "overlap": True, "outer_dtype": "int8"},
    # streaming_h40 with plain averaging as the outer step (SGD lr 1, no momentum: FedAvg's) instead of
    # Nesterov 0.7 / 0.9, which overshoots when each fragment gets only a few outer steps (README).
    "streaming_h40_avg": {
        "sync_every": 40,
        "fragments": 4,
        "overlap": True,
        "outer_dtype": "int8",
        "outer": (1.0, 0.0),
    },
    # Ablations of streaming_h40 (not in the default run): float32 outer gradients; no overlap.
    "streaming_h40_f32": {"sync_every": 40, "fragments": 4, "overlap": True},
    "streaming_h40_no_overlap": {"sync_every": 40, "fragments": 4, "outer_dtype": "int8"},
}
HEADLINE = ["hybrid_shard", "diloco_h10", "diloco_h50", "streaming_h40", "streaming_h40_avg"]
LINKS = {"100mbit": "100mbit", "1gbit": "1gbit"}
VOCAB, SEQ, RANKS_PER_HOST, DELAY = 128, 64, 2, "10ms"


# -- data ----------------------------------------------------------------------------------------------
def corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token ids: the stdlib's own ``*.py`` files, sorted, as ASCII (others -> 0)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    ids = np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8).astype(np.int64)
    ids[ids >= VOCAB] = 0
    cut = int(len(ids) * 0.95)
    return ids[:cut], ids[cut:]


def windows(text: np.ndarray, starts: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.stack([text[s : s + SEQ] for s in starts]))


# -- one rank --------------------------------------------------------------------------------------------
def link_bytes(dev: str | None) -> int | None:
    if not dev:
        return None
    stats = Path("/sys/class/net") / dev / "statistics"
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import paramplane as pp
    from paramplane.examples.train_gpt import TinyGPT

    torch.set_num_threads(1)
    train, val = corpus(args.corpus_bytes)
    world = pp.init()
    rank = world.rank
    torch.manual_seed(0)
    model: Any = TinyGPT(vocab=VOCAB, seq=SEQ, dim=args.dim, layers=args.layers, heads=4)
    num_params = sum(p.numel() for p in model.parameters())
    spec = VARIANTS[args.variant]
    diloco = None
    if not spec:
        fsdp = pp.FSDP(model, world.group, "hybrid_shard")
        opt = torch.optim.AdamW(fsdp.parameters(), lr=args.lr)
    else:
        hosts = world.world_size // RANKS_PER_HOST
        mesh = pp.Mesh(world.group, dims=[("replicate", hosts), ("shard", RANKS_PER_HOST)])
        fsdp = pp.FSDP(model, mesh.group("shard"), "full_shard")
        opt = torch.optim.AdamW(fsdp.parameters(), lr=args.lr)
        kw = {k: v for k, v in spec.items() if k != "outer"}
        outer = (args.outer_lr, args.outer_momentum) if args.outer_lr is not None else spec.get("outer")
        if outer is not None:  # else DiLoCo's default outer optimizer (Nesterov SGD 0.7 / 0.9)
            kw["outer_optimizer"] = torch.optim.SGD(
                fsdp.parameters(), lr=outer[0], momentum=outer[1], nesterov=outer[1] > 0
            )
        if args.alpha is not None and spec.get("overlap"):
            kw["alpha"] = args.alpha
        diloco = pp.DiLoCo(fsdp, opt, mesh.group("replicate"), **kw)
    val_starts = np.random.default_rng(12345).integers(0, len(val) - SEQ, args.val_windows)

    def evaluate() -> float:
        with torch.no_grad():
            losses = [
                float(fsdp(windows(val, val_starts[i : i + 16]), windows(val, val_starts[i : i + 16])))
                for i in range(0, len(val_starts), 16)
            ]
        return float(np.mean(losses))

    world.group.barrier()
    dev = os.environ.get("PPDL_VETH") if rank == 0 else None
    bytes0, clock, cpu, curve, unsynced = link_bytes(dev), 0.0, 0.0, [], None
    mark, cpu_mark = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        rng = np.random.default_rng(step * 1000 + rank)
        ids = windows(train, rng.integers(0, len(train) - SEQ, args.batch))
        fsdp(ids, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            if done == args.steps:
                if diloco is not None:  # every replica ends on the averaged model (a fragment may lag)
                    diloco.finish()
                    paused, cpu_paused = time.perf_counter(), time.process_time()
                    unsynced = evaluate()
                    mark += time.perf_counter() - paused  # not training time
                    cpu_mark += time.process_time() - cpu_paused
                    diloco.sync_all()
                world.group.barrier()  # the end: every rank is done
                bytes1 = link_bytes(dev)
            clock += time.perf_counter() - mark
            cpu += time.process_time() - cpu_mark
            curve.append([done, round(clock, 3), round(evaluate(), 5)])
            if rank == 0:
                print(f"  {args.variant} step {done}: {curve[-1][1]} s, loss {curve[-1][2]}, cpu {cpu:.1f} s",
                      file=sys.stderr)  # fmt: skip
            mark, cpu_mark = time.perf_counter(), time.process_time()
    world.group.barrier()
    world.shutdown()
    if rank != 0:
        return {}
    return {
        "num_params": num_params,
        "train_s": round(clock, 3),
        "cpu_s": round(cpu, 3),  # rank 0's process CPU time over the same spans (its comm threads included)
        "curve": curve,
        "final_val_loss": curve[-1][2],
        "final_val_loss_before_sync_all": unsynced,
        "link_bytes": None if bytes0 is None else bytes1 - bytes0,  # type: ignore[operator]
    }


# -- the hosts -------------------------------------------------------------------------------------------
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class TwoHosts:
    """Two namespaces joined by a shaped veth pair; ``close`` deletes them (idempotent)."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns = (f"ppdl-{pid}-a", f"ppdl-{pid}-b")
        self.dev = (f"ppdl{pid % 10**7}a", f"ppdl{pid % 10**7}b")
        subnet = f"10.214.{pid % 250 + 1}"
        self.addr = (f"{subnet}.1", f"{subnet}.2")
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def shape(self, rate: str) -> str:
        """Shape both ends to ``rate`` and ``DELAY``; returns the qdisc used. Where the kernel lacks netem
        (``sch_netem``), a token bucket (``tbf``) limits the rate alone, with no added delay."""
        bits = {"100mbit": 100e6, "1gbit": 1e9}[rate]
        burst = f"{max(32_000, int(bits / 100)) // 8}b"  # 10 ms of traffic (tbf needs >= rate / HZ)
        for ns, dev in zip(self.ns, self.dev, strict=True):
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root"]
            netem = subprocess.run([*tc, "netem", "rate", rate, "delay", DELAY, "limit", "100000"],
                                   capture_output=True, timeout=20)  # fmt: skip
            if netem.returncode != 0:
                subprocess.run([*tc, "tbf", "rate", rate, "burst", burst, "latency", "100ms"],
                               check=True, capture_output=True, timeout=20)  # fmt: skip
        return f"netem rate {rate} delay {DELAY}" if netem.returncode == 0 else f"tbf rate {rate} (no netem)"

    def close(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def run_variant(args: argparse.Namespace, variant: str, hosts: TwoHosts | None) -> dict[str, Any]:
    """All ranks of one variant; rank 0's result."""
    world = 2 * RANKS_PER_HOST
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--variant", variant]
    for flag in ("steps", "dim", "layers", "batch", "lr", "eval_every", "val_windows", "corpus_bytes"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("outer_lr", "outer_momentum", "alpha"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    token = secrets.token_hex(16)
    load = os.getloadavg()[0]  # the machine's 1-minute load average at the start and the end
    base = dict(os.environ, PARAMPLANE_TOKEN=token, PARAMPLANE_TIMEOUT="300", PYTHONUNBUFFERED="1")
    base.pop("PARAMPLANE_TRANSPORT", None)
    wrap = [[], []] if hosts is None else [["ip", "netns", "exec", ns] for ns in hosts.ns]
    coord_host = "127.0.0.1" if hosts is None else hosts.addr[0]
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        coord = subprocess.Popen(
            [*wrap[0], sys.executable, "-m", "paramplane.coordinator", "--host", coord_host, "--port", "0",
             "--world-size", str(world), "--port-file", str(port_file), "--heartbeat-timeout", "120"],
            env=base, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        procs: list[subprocess.Popen[str]] = []
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text().strip():
                if coord.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the coordinator did not start: {coord.stderr.read()!r}")  # type: ignore[union-attr]
                time.sleep(0.05)  # the coordinator writes its port file once it listens
            address = f"{coord_host}:{port_file.read_text().strip()}"
            for r in range(world):
                host = r // RANKS_PER_HOST
                env = dict(base, PARAMPLANE_COORDINATOR=address, PARAMPLANE_RANK=str(r),
                           PARAMPLANE_WORLD_SIZE=str(world), PARAMPLANE_HOST_ID=f"host{host}")  # fmt: skip
                if hosts is not None:
                    env.update(PARAMPLANE_BIND=hosts.addr[host], PPDL_VETH=hosts.dev[host])
                procs.append(
                    subprocess.Popen([*wrap[host], *cmd], env=env, stdout=subprocess.PIPE, text=True)
                )
            outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        finally:
            everyone: list[subprocess.Popen[Any]] = [*procs, coord]
            for p in everyone:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{variant}: ranks exited with {failed}")
    return dict(json.loads(outs[0].strip().splitlines()[-1]), load_avg=[load, os.getloadavg()[0]])


def summarise(link: str, results: dict[str, dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    base = results["hybrid_shard"]
    target = round(1.03 * base["final_val_loss"], 5)

    def to_target(res: dict[str, Any]) -> float | None:
        return next((t for _, t, loss in res["curve"] if loss <= target), None)

    t_base = to_target(base)
    rows = []
    for variant, res in results.items():
        per_step = None if res["link_bytes"] is None else res["link_bytes"] / steps
        base_per_step = None if base["link_bytes"] is None else base["link_bytes"] / steps
        t = to_target(res)
        rows.append(
            {
                "bench": "diloco",
                "link": link,
                "variant": variant,
                **{k: v for k, v in VARIANTS[variant].items() if k != "outer"},
                "outer_lr_momentum": VARIANTS[variant].get("outer"),
                "steps": steps,
                "num_params": res["num_params"],
                "link_bytes_per_step": per_step,
                "bytes_reduction_vs_hybrid": (base_per_step / per_step)
                if per_step and base_per_step
                else None,
                "train_s": res["train_s"],
                "cpu_s_per_step": None if res.get("cpu_s") is None else res["cpu_s"] / steps,
                "target_val_loss": target,
                "time_to_target_s": t,
                "time_to_target_ratio_vs_hybrid": (t / t_base) if t is not None and t_base else None,
                "final_val_loss": res["final_val_loss"],
                "final_loss_ratio_vs_hybrid": res["final_val_loss"] / base["final_val_loss"],
                "final_val_loss_before_sync_all": res.get("final_val_loss_before_sync_all"),
                "load_avg_start_end": res.get("load_avg"),
                "curve": res["curve"],
            }
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link"] for r in rows})
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.2), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        mine = [r for r in rows if r["link"] == link]
        for r in mine:
            _, t, loss = zip(*r["curve"], strict=True)
            color = f"C{list(VARIANTS).index(r['variant']) % 10}"  # the same colour on every link
            ax.plot(t, loss, marker=".", label=r["variant"], color=color)
        ax.axhline(mine[0]["target_val_loss"], color="grey", ls=":", lw=1, label="target")
        ax.set(
            title=str(mine[0].get("shaping", link)), xlabel="training wall time (s)", ylabel="validation loss"
        )
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument(
        "--variants",
        default=",".join(HEADLINE),
        help=f"comma-separated of {list(VARIANTS)}, hybrid_shard first",
    )
    p.add_argument("--links", default="100mbit,1gbit", help=f"comma-separated of {list(LINKS)}")
    p.add_argument("--no-netns", action="store_true", help="ranks on 127.0.0.1, no link (bytes: null)")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="windows of 64 characters per rank and step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--timeout", type=float, default=2400.0, help="seconds per variant")
    p.add_argument("--outer-lr", type=float, help="DiLoCo variants: outer SGD lr (default: DiLoCo's 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="with --outer-lr (Nesterov when > 0)")
    p.add_argument("--alpha", type=float, help="streaming variants: DiLoCo's alpha (default: None)")
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    variants = args.variants.split(",")
    links = ["none"] if args.no_netns else args.links.split(",")
    if (
        variants[0] != "hybrid_shard"
        or not set(variants) <= set(VARIANTS)
        or not set(links) <= {*LINKS, "none"}
    ):
        p.error(f"--variants: hybrid_shard first, of {list(VARIANTS)}; --links of {list(LINKS)}")
    if not args.no_netns and (os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None):
        p.error("network namespaces need root, iproute2 and tc: run as root, or pass --no-netns")
    hosts = None if args.no_netns else TwoHosts()
    # SIGTERM ends the run like Ctrl-C: the finally below still deletes the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict[str, Any]] = []
    try:
        for link in links:
            shaping = "none" if hosts is None else hosts.shape(LINKS[link])
            results = {}
            for v in variants:
                results[v] = run_variant(args, v, hosts)
                print(
                    f"{link} {v}: {results[v]['train_s']} s, loss {results[v]['final_val_loss']}",
                    file=sys.stderr,
                )
            mine = [dict(r, shaping=shaping) for r in summarise(link, results, args.steps)]
            emit([json.dumps(r) for r in mine], args.out)  # each link as soon as it is done
            rows += mine
            if args.plot:
                plot(rows, args.plot)
    finally:
        if hosts is not None:
            hosts.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
