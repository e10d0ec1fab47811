"""FSDP on cupy arrays (NCCL inside the host): full_shard equals the numpy reference; float16 mixed
precision trains close to float32; CPU offload of device parameters is refused clearly."""

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
    want = reference(np.float32, "sgd", 3, 1, False, None)
    a, b = shard_range(BATCH, world.world_size, world.rank)
    for name, mp in (
        ("fp32", None),
        ("fp16", pp.MixedPrecision(param_dtype="float16", reduce_dtype="float32")),
    ):
        model = make_model(np.float32).to("cuda")
        fsdp = pp.FSDP(model, world.group, mixed_precision=mp)
        rep.check(
            f"{name}: shards on the device",
            all(type(p.data).__module__.startswith("cupy") for p in fsdp.parameters()),
        )
        opt = SGD(fsdp.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        fsdp.attach(opt)
        crit = CrossEntropyLoss()
        for step in range(3):
            x, y = batch(step, np.float32)
            crit.forward(fsdp(cupy.asarray(x[a:b])).astype(cupy.float32), cupy.asarray(y[a:b]))
            fsdp.backward(crit.backward())
            opt.step()
            opt.zero_grad()
        got = {k: cupy.asnumpy(v) for k, v in fsdp.state_dict().items()}
        rtol = 1e-4 if name == "fp32" else 5e-2
        for key, value in want["state"].items():
            err = float(np.max(np.abs(got[key] - value) / np.maximum(np.abs(value), 1e-2)))
            rep.check(f"{name}: {key}", err <= rtol, f"relative error {err:.3g} > {rtol}")
    rep.raises(
        "offload of device parameters",
        NotImplementedError,
        lambda: pp.FSDP(
            make_model(np.float32).to("cuda"), world.group, cpu_offload=pp.CPUOffload(params=True)
        ),
        "not implemented",
    )


if __name__ == "__main__":
    run_rank(scenario)
