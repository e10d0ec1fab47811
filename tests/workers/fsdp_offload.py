"""FSDP CPU offload on a machine without a GPU, with a recording device module (fake_device.py):
offloaded shards, gradients and optimizer state are host (numpy) arrays, gathered parameters and the
forward output are device arrays, every shard goes to the device once per gather, and training equals
both the reference on one process and the same run without offload."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_device
from _common import Report, run_rank
from fsdp import BATCH, batch, make_model, reference

import paramplane as pp
from paramplane.nn import CrossEntropyLoss
from paramplane.optim import SGD
from paramplane.parallel.ddp import shard_range


def scenario(world: Any, rep: Report) -> None:
    fake = fake_device.MODULE
    want = reference(np.float32, "sgd", 3, 1, False, None)
    a, b = shard_range(BATCH, world.world_size, world.rank)
    for offload in (False, True):
        tag = "offload" if offload else "on device"
        model = make_model(np.float32)
        for p in model.parameters():
            p.data = fake.asarray(p.data)
        fsdp = pp.FSDP(model, world.group, cpu_offload=pp.CPUOffload(params=offload))
        rep.check(
            f"{tag}: shards in {'host' if offload else 'device'} memory",
            all((type(p.data) is np.ndarray) == offload for p in fsdp.parameters()),
        )
        opt = SGD(fsdp.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        fsdp.attach(opt)
        crit = CrossEntropyLoss()
        for step in range(3):
            x, y = batch(step, np.float32)
            fake_device.WATCH.clear()
            fake_device.WATCH.update(id(p.data) for p in fsdp.parameters())
            fake_device.RECORD["watched_h2d"] = 0
            out = fsdp(fake.asarray(x[a:b]))
            rep.check(f"{tag}: forward output on the device", isinstance(out, fake_device.DeviceArray))
            crit.forward(out, fake.asarray(y[a:b]))
            fsdp.backward(crit.backward())
            fsdp.finish_gradient_sync()
            grads_on_host = all(type(p.grad) is np.ndarray for p in fsdp.parameters())
            rep.check(
                f"{tag}: gradients in {'host' if offload else 'device'} memory", grads_on_host == offload
            )
            copies = fake_device.RECORD["watched_h2d"]
            num_units = len(fsdp.units)
            if offload:  # full_shard gathers every unit for forward and again for backward
                rep.check(
                    "offload: each shard goes to the device once per gather",
                    copies == 2 * num_units,
                    f"{copies} shard copies for {num_units} units",
                )
                rep.values["shard_copies_per_step"] = copies
            else:
                rep.check("on device: no shard crosses to the device", copies == 0, f"{copies}")
            opt.step()
            opt.zero_grad()
        states = [v for st in opt.state.values() for v in st.values() if hasattr(v, "shape")]
        rep.check(
            f"{tag}: optimizer state in {'host' if offload else 'device'} memory",
            bool(states) and all((type(v) is np.ndarray) == offload for v in states),
        )
        got = {k: np.asarray(v.get() if hasattr(v, "get") else v) for k, v in fsdp.state_dict().items()}
        for key, value in want["state"].items():
            err = float(np.max(np.abs(got[key] - value) / np.maximum(np.abs(value), 1e-2)))
            rep.check(f"{tag}: {key} equals the reference", err <= 1e-4, f"relative error {err:.3g}")


if __name__ == "__main__":
    run_rank(scenario)
