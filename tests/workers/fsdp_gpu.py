"""FSDP (``fsdp_gpu.py [STRATEGY]``, full_shard by default) on cupy arrays (NCCL inside the host): full_shard equals the numpy reference; float16 mixed
precision trains close to float32; so does DDP on cupy; with CPU offload the shards, gradients and optimizer state stay in
host memory and training still equals the reference."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank
from fsdp import BATCH, batch, make_model, reference

import paramplane as pp
from paramplane.nn import CrossEntropyLoss
from paramplane.optim import SGD
from paramplane.parallel.ddp import shard_range


def scenario(world: Any, rep: Report) -> None:
    import cupy

    world.use_gpu()
    strategy = sys.argv[1] if len(sys.argv) > 1 else "full_shard"
    want = reference(np.float32, "sgd", 3, 1, False, None)
    a, b = shard_range(BATCH, world.world_size, world.rank)
    runs = [
        ("fp32", None, False),
        ("fp16", pp.MixedPrecision(param_dtype="float16", reduce_dtype="float32"), False),
        ("offload", None, True),
        ("ddp", None, False),
    ]
    for name, mp, offload in runs if strategy == "full_shard" else runs[:3]:
        model = make_model(np.float32).to("cuda")
        if name == "ddp":
            fsdp: Any = pp.DDP(model, world.group)
        else:
            fsdp = pp.FSDP(
                model,
                world.group,
                strategy=strategy,
                mixed_precision=mp,
                cpu_offload=pp.CPUOffload(params=offload),
            )
        rep.check(
            f"{name}: parameters {'in host memory' if offload else 'on the device'}",
            all(isinstance(p.data, np.ndarray) == offload for p in fsdp.parameters()),
        )
        opt = SGD(fsdp.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        fsdp.attach(opt)
        crit = CrossEntropyLoss()
        for step in range(3):
            x, y = batch(step, np.float32)
            crit.forward(fsdp(cupy.asarray(x[a:b])).astype(cupy.float32), cupy.asarray(y[a:b]))
            fsdp.backward(crit.backward())
            if offload:
                fsdp.finish_gradient_sync()
                rep.check(
                    "offload: gradients in host memory",
                    all(isinstance(p.grad, np.ndarray) for p in opt.params),
                )
            opt.step()
            opt.zero_grad()
        if offload:
            host_type = 1  # cudaMemoryTypeHost: page-locked; plain numpy memory reads as unregistered (0)
            rep.check(
                "offload: shards and gradients page-locked",
                all(
                    cupy.cuda.runtime.pointerGetAttributes(a.ctypes.data).type == host_type
                    for p in fsdp.parameters()
                    for a in (p.data, *(() if p.grad is None else (p.grad,)))
                ),
            )
            states = [v for st in opt.state.values() for v in st.values() if hasattr(v, "shape")]
            rep.check(
                "offload: optimizer state in host memory",
                bool(states) and all(isinstance(v, np.ndarray) for v in states),
            )
            # A full state dict of device arrays loads into the host shards; the forward still runs on the GPU.
            full = {k: cupy.asarray(v) for k, v in fsdp.state_dict().items()}
            fsdp.load_state_dict(full)
            x, _ = batch(0, np.float32)
            rep.check(
                "offload: forward output on the device",
                type(fsdp(cupy.asarray(x[a:b]))).__module__.startswith("cupy"),
            )
        if name != "ddp":
            pool = fsdp.memory_stats().get("device_pool", {})
            rep.check(
                f"{name}: device pool bytes reported",
                0 < pool.get("used", 0) <= pool.get("total", 0),
                str(pool),
            )
        got = {k: cupy.asnumpy(v) for k, v in fsdp.state_dict().items()}
        rtol = 5e-2 if name == "fp16" else 1e-4
        for key, value in want["state"].items():
            err = float(np.max(np.abs(got[key] - value) / np.maximum(np.abs(value), 1e-2)))
            rep.check(f"{name}: {key}", err <= rtol, f"relative error {err:.3g} > {rtol}")


if __name__ == "__main__":
    run_rank(scenario)
