"""Torch models under pp.DDP / pp.FSDP beside torch's DDP / FSDP2 (gloo): step time and peak memory per rank.

    python benchmarks/torch_models.py --out benchmarks/results/torch_models.jsonl
    python benchmarks/torch_models.py --models gpt2 --worlds 2 --layers 2 --steps 3   # smaller

The same torch module, built from the same seed on every rank, trains with ``torch.optim.AdamW`` on random
data (``--local-batch`` per rank, float32, no autocast):

- ``gpt2``: transformers ``GPT2LMHeadModel`` from a config (``--layers`` 8, ``--embd`` 512, 8 heads,
  ``--vocab`` 32000, ``--seq`` 128: about 42M parameters, input embedding tied to the head);
- ``resnet``: transformers ``ResNetForImageClassification`` shaped as ResNet-18 (basic layers, depths
  ``--resnet-depth`` x4 = [2, 2, 2, 2], hidden sizes ``--resnet-width`` x [1, 2, 4, 8] = [64, ..., 512],
  1000 classes, ``--image`` px; BatchNorm buffers). torchvision does not load with torch 2.13's CPU build.

Each model runs under four wrappers at every world size of ``--worlds``: ``pp.DDP`` and torch's
``DistributedDataParallel`` (gloo), ``pp.FSDP(model, group, "full_shard")`` with its default units and torch
FSDP2's ``fully_shard`` on every block (GPT2Block, ResNetBasicLayer) and then the root, as torch's examples do.
Each runs at its own defaults: paramplane ranks get the launcher's MALLOC_* settings (``--malloc none``: glibc's
own, to see what they cost), torch none of ours; both get one thread per rank (``OMP_NUM_THREADS=1``, as
torchrun sets for several ranks on a host).

Per rank: the median step time over ``--steps`` steps after ``--warmup`` (zero_grad, forward, backward,
optimizer step); ``train_rss_peak``, the peak resident set while training (VmHWM, reset with
``/proc/self/clear_refs`` once the model is wrapped and the data made: what a rank holds while it trains,
its gathered units and buckets included; ``train_rss_start``, the resident set at that reset), and
``rss_peak``, the whole process's peak (``ru_maxrss``: the full model every rank builds before wrapping
included). A row reports the slowest rank's median and the
largest peaks; paramplane rows carry ratios against torch's row of the same model, wrapper and world
(``step_vs_torch``, ``train_peak_vs_torch``: below 1 is better). One JSON line per configuration.

Rows also carry ``cpu_s_median`` (the process's CPU seconds per step, all its threads) and ``faults_median``
(minor page faults per step), with ``cpu_vs_torch``: the work a step costs, less distorted than its wall time
when other load shares the host. ``--phase-peaks``: each phase's resident peak as well (``phase_peaks_max``:
forward, backward, the first optimizer step, later ones; the peak is reset at each phase's end, so a phase's
peak starts from what the previous one left resident).

``--bucket-mb N`` (a diagnostic, not both at their defaults): both DDPs with N MiB buckets (``bucket_mb`` /
``bucket_cap_mb``), to see what each pays per bucket; ``--grad-as-view``: both with
``gradient_as_bucket_view=True``.

``--repeats N``: every configuration N times, the two implementations taking turns to go first (ours first in
even repeats), each row tagged with its ``repeat``; ratios pair the rows of one repeat, and a ``summary`` row per
configuration gives the median and the range of each ratio over the repeats: on two shared cores one pair of
runs of four ranks each varies by several percent, more than the differences it is run to find.

``--torch-backend``: a third implementation per configuration, torch's own ``DistributedDataParallel`` /
FSDP2 over paramplane's ``torch.distributed`` backend (``pp.init_torch_distributed``; rows ``torch-paramplane``,
ratios against torch's gloo row like ours; CPU only).

``--device cuda`` (a GPU machine): the same on CUDA, torch's peers on NCCL instead of gloo. Each rank takes
its GPU (``world.use_gpu()``; ranks share GPU 0 where there are fewer GPUs, and torch's ranks then get the
same ``NCCL_HOSTID`` per rank that paramplane's runtime sets, see ``_gpu.peer_rank_env``); a step ends with
``torch.cuda.synchronize()``; ``gpu_peak`` is ``torch.cuda.max_memory_allocated()`` while training
(``gpu_peak_vs_torch``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, cast

from paramplane.benchmarks._gpu import peer_rank_env
from paramplane.benchmarks._jsonl import emit
from paramplane.launch import MALLOC_DEFAULTS
from paramplane.local_world import json_lines, run_world

MODELS = ("gpt2", "resnet")
MODES = ("ddp", "fsdp")
WRAPPERS = {
    ("paramplane", "ddp"): "pp.DDP",
    ("torch", "ddp"): "torch DDP (gloo)",
    ("paramplane", "fsdp"): "pp.FSDP full_shard",
    ("torch", "fsdp"): "torch FSDP2 fully_shard (gloo)",
    ("torch-paramplane", "ddp"): "torch DDP (paramplane backend)",
    ("torch-paramplane", "fsdp"): "torch FSDP2 fully_shard (paramplane backend)",
}
OURS = ("paramplane", "torch-paramplane")  # impls whose ranks run on paramplane's plane
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MALLOC = MALLOC_DEFAULTS  # the launcher's, for paramplane ranks only
SIZE_FLAGS = ("layers", "embd", "vocab", "seq", "resnet_depth", "resnet_width", "image", "local_batch")


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _reset_hwm() -> bool:
    """Reset this process's VmHWM (Linux: ``5`` to ``clear_refs``); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _hwm(field: str = "VmHWM") -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _phase(peaks: dict[str, int], name: str, on: bool) -> None:
    """``--phase-peaks``: record the resident peak since the last phase under ``name`` (the largest over the
    steps) and reset it, so each phase's peak is its own."""
    if not on:
        return
    peak = _hwm() or 0
    peaks[name] = max(peaks.get(name, 0), peak)
    _reset_hwm()


def build(model: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """The model (same weights for the same seed) and its block class (the FSDP unit torch users wrap)."""
    import torch

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_layer=args.layers,
            n_embd=args.embd,
            n_head=8 if args.embd % 8 == 0 else 1,
            vocab_size=args.vocab,
            n_positions=args.seq,
            bos_token_id=0,
            eos_token_id=0,
        )
        gpt = GPT2LMHeadModel(cfg)
        return gpt, type(gpt.transformer.h[0])
    from transformers import ResNetConfig, ResNetForImageClassification

    w = args.resnet_width
    rcfg = cast(Any, ResNetConfig)(  # transformers' stubs do not list the PretrainedConfig keywords
        num_labels=1000,
        embedding_size=w,
        hidden_sizes=[w, 2 * w, 4 * w, 8 * w],
        depths=[args.resnet_depth] * 4,
        layer_type="basic",
    )
    resnet: Any = ResNetForImageClassification(rcfg)
    return resnet, type(resnet.resnet.encoder.stages[0].layers[0])


def make_batch(model: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    if model == "gpt2":
        ids = torch.randint(0, args.vocab, (args.local_batch, args.seq), generator=gen)
        return {"input_ids": ids, "labels": ids}
    pixels = torch.randn(args.local_batch, 3, args.image, args.image, generator=gen)
    return {"pixel_values": pixels, "labels": torch.randint(0, 1000, (args.local_batch,), generator=gen)}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of ``args.impl`` running ``args.model`` under ``args.mode``."""
    import torch

    import paramplane as pp

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    world: Any = None
    if args.impl in OURS:
        world = pp.init()
        if cuda:
            torch.cuda.set_device(world.use_gpu())
        if args.impl == "torch-paramplane":  # torch's own wrappers over the plane
            pp.init_torch_distributed(world)
    else:
        import torch.distributed as dist

        if cuda:
            torch.cuda.set_device(args.rank % torch.cuda.device_count())
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"file://{args.store}",
            rank=args.rank,
            world_size=args.world_size,
        )
    rss_start = _rss_peak()
    model, block = build(args.model, args)
    if cuda:
        model = model.cuda()
    params = sum(p.numel() for p in model.parameters())
    wrapped: Any
    if args.impl == "paramplane":
        wrapped = (
            pp.DDP(model, world.group, **_bucket(args, "bucket_mb"))
            if args.mode == "ddp"
            else pp.FSDP(model, world.group, "full_shard")
        )
    elif args.mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, **_bucket(args, "bucket_cap_mb"))
    else:
        from torch.distributed.fsdp import fully_shard

        for m in list(model.modules()):
            if isinstance(m, block):
                fully_shard(m)
        wrapped = fully_shard(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    batch = make_batch(args.model, args, args.rank)
    if cuda:
        batch = {k: v.cuda() for k, v in batch.items()}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    hwm_reset = _reset_hwm()
    train_rss_start = _hwm("VmRSS")
    times = []
    phases: dict[str, int] = {}
    cpu, faults = [], []
    for i in range(args.warmup + args.steps):
        t, c, f = time.perf_counter(), time.process_time(), _minflt()
        opt.zero_grad(set_to_none=True)
        loss = wrapped(**batch).loss
        _phase(phases, "forward", args.phase_peaks and hwm_reset)
        loss.backward()
        del loss
        _phase(phases, "backward", args.phase_peaks and hwm_reset)
        opt.step()
        _phase(phases, "step1" if i == 0 else "step", args.phase_peaks and hwm_reset)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            faults.append(_minflt() - f)
    out = {
        "params": params,
        "times": times,
        "cpu": cpu,
        "faults": faults,
        "rss_peak": _rss_peak(),
        "rss_growth": _rss_peak() - rss_start,
        "train_rss_peak": (max([*phases.values(), _hwm() or 0]) if phases else _hwm()) if hwm_reset else None,
        "phase_peaks": phases or None,
        "train_rss_start": train_rss_start,
        "gpu_peak": int(torch.cuda.max_memory_allocated()) if cuda else None,
    }
    if args.impl != "paramplane":
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if world is not None:
        world.group.barrier()
        world.shutdown()
    return out


def _spawn(impl: str, model: str, mode: str, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--impl", impl, "--models", model]
    cmd += [
        "--mode",
        mode,
        "--world-size",
        str(world),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    for flag in SIZE_FLAGS:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    cmd += ["--device", args.device, "--bucket-mb", str(args.bucket_mb)]
    cmd += ["--grad-as-view"] if args.grad_as_view else []
    cmd += ["--phase-peaks"] if args.phase_peaks else []
    rank_env = None
    if args.device == "cuda":
        import torch

        rank_env = peer_rank_env(impl, world, torch.cuda.device_count())
    env = dict(os.environ, **THREADS, PARAMPLANE_TIMEOUT="600")
    if impl in OURS and args.malloc == "launcher":  # our launcher's defaults; torch runs at its own
        for key, value in MALLOC.items():
            env.setdefault(key, value)
    else:
        for key in MALLOC:
            env.pop(key, None)
    with tempfile.TemporaryDirectory() as tmp:
        return json_lines(
            run_world(
                world,
                lambda r: [*cmd, "--rank", str(r), "--store", os.path.join(tmp, "store")],
                env=env,
                rank_env=rank_env,
                coordinator=impl in OURS,
                timeout_s=args.rank_timeout,
                stderr="inherit",
            ),
            f"{_wrapper(impl, mode, args.device)} on {model} at world {world}",
        )


def _bucket(args: argparse.Namespace, keyword: str) -> dict[str, Any]:
    """The DDP keywords of ``--bucket-mb`` (nothing at 0: each wrapper's default) and ``--grad-as-view``."""
    return ({keyword: args.bucket_mb} if args.bucket_mb else {}) | (
        {"gradient_as_bucket_view": True} if args.grad_as_view else {}
    )


def _wrapper(impl: str, mode: str, device: str) -> str:
    name = WRAPPERS[impl, mode]
    return name.replace("(gloo)", "(nccl)") if device == "cuda" else name


def _row(
    impl: str, model: str, mode: str, world: int, ranks: list[dict[str, Any]], args: Any
) -> dict[str, Any]:
    train_peaks = [r["train_rss_peak"] for r in ranks]
    return {
        "bench": "torch_models",
        "model": model,
        "mode": mode,
        "impl": impl,
        "wrapper": _wrapper(impl, mode, args.device),
        "device": args.device,
        "world_size": world,
        "params": ranks[0]["params"],
        "local_batch": args.local_batch,
        **({"bucket_mb": args.bucket_mb} if mode == "ddp" and args.bucket_mb else {}),
        **({"gradient_as_bucket_view": True} if mode == "ddp" and args.grad_as_view else {}),
        "steps": args.steps,
        "warmup": args.warmup,
        "step_s_median": max(statistics.median(r["times"]) for r in ranks),
        "step_s_min": min(min(r["times"]) for r in ranks),
        # CPU seconds of the process (all its threads) per step, and minor page faults per step: the work a
        # step costs, less distorted by other load on the host than its wall time
        "cpu_s_median": max(statistics.median(r["cpu"]) for r in ranks),
        "faults_median": max(statistics.median(r["faults"]) for r in ranks),
        "train_rss_peak_max": None if None in train_peaks else max(train_peaks),
        "train_rss_start_max": max(r.get("train_rss_start") or 0 for r in ranks) or None,
        "rss_peak_max": max(r["rss_peak"] for r in ranks),
        "rss_growth_max": max(r["rss_growth"] for r in ranks),
        "gpu_peak_max": max(r["gpu_peak"] or 0 for r in ranks) or None,
        **({"phase_peaks_max": _phase_max(ranks)} if args.phase_peaks else {}),
        "threads_per_rank": 1,
        "malloc_env": impl in OURS and args.malloc == "launcher",
        # the trim threshold our ranks ran with (the launcher's was 1 GiB before 2026-11-26; a user's env wins)
        "malloc_trim": (
            os.environ.get("MALLOC_TRIM_THRESHOLD_", MALLOC["MALLOC_TRIM_THRESHOLD_"])
            if impl in OURS and args.malloc == "launcher"
            else None
        ),
    }


def _phase_max(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """Per phase, the largest rank's resident peak."""
    out: dict[str, int] = {}
    for r in ranks:
        for name, peak in (r.get("phase_peaks") or {}).items():
            out[name] = max(out.get(name, 0), peak)
    return out


def _config(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["model"], row["mode"], row["world_size"]


RATIOS = ("step_vs_torch", "cpu_vs_torch", "train_peak_vs_torch", "rss_peak_vs_torch", "gpu_peak_vs_torch")


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Give each paramplane row (``pp.*`` or torch's wrappers over the backend) its ratios against torch's row of
    the same model, mode, world and repeat."""
    for row in rows:
        if row["impl"] not in OURS:
            continue
        peer = next(
            (
                r
                for r in rows
                if r["impl"] == "torch"
                and _config(r) == _config(row)
                and r.get("repeat", 0) == row.get("repeat", 0)
            ),
            None,
        )
        if peer is None:
            continue
        row["step_vs_torch"] = row["step_s_median"] / peer["step_s_median"]
        if row.get("cpu_s_median") and peer.get("cpu_s_median"):
            row["cpu_vs_torch"] = row["cpu_s_median"] / peer["cpu_s_median"]
        row["rss_peak_vs_torch"] = row["rss_peak_max"] / peer["rss_peak_max"]
        if row["train_rss_peak_max"] and peer["train_rss_peak_max"]:
            row["train_peak_vs_torch"] = row["train_rss_peak_max"] / peer["train_rss_peak_max"]
        if row.get("gpu_peak_max") and peer.get("gpu_peak_max"):  # CUDA rows only
            row["gpu_peak_vs_torch"] = row["gpu_peak_max"] / peer["gpu_peak_max"]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration run more than once (``--repeats``): each ratio's median, lowest and highest
    over the repeats."""
    configs: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        if row["impl"] in OURS and "step_vs_torch" in row:
            configs.setdefault((row["impl"], *_config(row)), []).append(row)
    out = []
    for (impl, model, mode, world), runs in configs.items():
        if len(runs) < 2:
            continue
        summary: dict[str, Any] = {
            "bench": "torch_models",
            "summary": True,
            "impl": impl,
            "model": model,
            "mode": mode,
            "world_size": world,
            "device": runs[0]["device"],
            "repeats": len(runs),
        }
        for key in RATIOS:
            values = [r[key] for r in runs if key in r]
            if values:
                summary[f"{key}_median"] = statistics.median(values)
                summary[f"{key}_range"] = [min(values), max(values)]
        out.append(summary)
    return out


def _csv(text: str, allowed: tuple[str, ...], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    items = [s for s in text.split(",") if s]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        parser.error(f"{flag} takes a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="gpt2,resnet")
    parser.add_argument("--modes", default=",".join(MODES), help="ddp,fsdp")
    parser.add_argument("--worlds", default="2,4", help="world sizes (default 2,4)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per rank (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--layers", type=int, default=8, help="GPT-2 blocks (default 8)")
    parser.add_argument("--embd", type=int, default=512, help="GPT-2 width (default 512)")
    parser.add_argument("--vocab", type=int, default=32000, help="GPT-2 vocabulary (default 32000)")
    parser.add_argument("--seq", type=int, default=128, help="GPT-2 sequence length (default 128)")
    parser.add_argument("--resnet-depth", type=int, default=2, help="ResNet layers per stage (default 2)")
    parser.add_argument("--resnet-width", type=int, default=64, help="ResNet first stage width (default 64)")
    parser.add_argument("--image", type=int, default=224, help="ResNet image side in px (default 224)")
    parser.add_argument("--local-batch", type=int, default=4, help="samples per rank per step (default 4)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: torch's peers on NCCL"
    )
    parser.add_argument("--rank-timeout", type=float, default=1800.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=0.0,
        help="both DDPs' bucket size in MiB, a diagnostic of the per-bucket cost (0: each one's default, 25)",
    )
    parser.add_argument(
        "--grad-as-view",
        action="store_true",
        help="both DDPs with gradient_as_bucket_view=True (not their default)",
    )
    parser.add_argument(
        "--phase-peaks",
        action="store_true",
        help="also report each phase's resident peak (forward, backward, first and later optimizer steps)",
    )
    parser.add_argument(
        "--malloc",
        choices=("launcher", "none"),
        default="launcher",
        help="paramplane ranks' MALLOC_* env: the launcher's (default) or glibc's own, as torch's ranks",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every configuration this many times, taking turns to go first (default 1); "
        "adds a summary row of the ratios' medians",
    )
    parser.add_argument("--out", type=Path, help="append the JSON lines here too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=("paramplane", "torch", "torch-paramplane"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--torch-backend",
        action="store_true",
        help="also run torch's own DDP / FSDP2 over paramplane's torch.distributed backend (pp.init_torch_distributed)",
    )
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [getattr(args, f) for f in SIZE_FLAGS] + [args.steps]
    if min(sizes) < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps, --repeats and the model sizes must be positive, --warmup at least 0")
    if args.bucket_mb < 0:
        parser.error("--bucket-mb must be at least 0 (0: each DDP's default)")
    models = _csv(args.models, MODELS, "--models", parser)
    modes = _csv(args.modes, MODES, "--modes", parser)
    if args.torch_backend and args.device != "cpu":
        parser.error("--torch-backend runs on CPU only (the backend takes CPU tensors)")
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1:
        parser.error(f"--worlds takes comma-separated positive world sizes, got {args.worlds!r}")
    if args.worker:
        args.model = models[0]
        print(json.dumps(worker(args)), flush=True)
        return 0
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        print(
            f"torch_models: needs torch and transformers ({exc}); pip install torch 'paramplane[test]'",
            file=sys.stderr,
        )
        return 1
    rows = []
    for model in models:
        for world in worlds:
            for mode in modes:
                for repeat in range(args.repeats):
                    impls = ["paramplane", "torch"] if repeat % 2 == 0 else ["torch", "paramplane"]
                    if args.torch_backend:
                        impls.append("torch-paramplane")
                    for impl in impls:
                        row = _row(impl, model, mode, world, _spawn(impl, model, mode, world, args), args)
                        rows.append(row | ({"repeat": repeat} if args.repeats > 1 else {}))
    add_ratios(rows)
    emit([json.dumps(r) for r in rows + summarize(rows)], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
