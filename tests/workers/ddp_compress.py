"""DDP with comm_dtype: buckets cross the wire in bfloat16 / float16 and training stays within that precision."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp
from paramplane.group import ProcessGroup
from paramplane.nn import Linear, MSELoss, ReLU, Sequential
from paramplane.optim import SGD


def train(world: Any, comm_dtype: str | None, seen: set[str]) -> dict[str, np.ndarray]:
    model = pp.DDP(
        Sequential(Linear(16, 32, rng=1), ReLU(), Linear(32, 4, rng=2)), world.group, comm_dtype=comm_dtype
    )
    opt = SGD(model.parameters(), lr=0.05)
    model.attach(opt)
    crit = MSELoss()
    original = ProcessGroup.all_reduce

    def recording(group: ProcessGroup, x: Any, *a: Any, **k: Any) -> Any:
        seen.add(str(x.dtype))
        return original(group, x, *a, **k)

    ProcessGroup.all_reduce = recording  # type: ignore[method-assign]
    try:
        for step in range(4):
            rng = np.random.default_rng(step * 10 + world.rank)
            crit.forward(
                model.forward(rng.standard_normal((8, 16)).astype(np.float32)),
                rng.standard_normal((8, 4)).astype(np.float32),
            )
            model.backward(crit.backward())
            opt.step()
            opt.zero_grad()
    finally:
        ProcessGroup.all_reduce = original  # type: ignore[method-assign]
    return model.state_dict()


def scenario(world: Any, rep: Report) -> None:
    seen_plain: set[str] = set()
    plain = train(world, None, seen_plain)
    rep.check("uncompressed buckets are float32", seen_plain == {"float32"}, str(seen_plain))
    for dtype, rtol in (("bfloat16", 1e-2), ("float16", 2e-3)):
        seen: set[str] = set()
        got = train(world, dtype, seen)
        rep.check(f"{dtype} on the wire", seen == {dtype}, str(seen))
        for (
            key,
            value,
        ) in plain.items():  # relative to the parameter's norm: near-zero elements carry no weight
            err = float(np.linalg.norm(got[key] - value) / np.linalg.norm(value))
            rep.check(f"{dtype} {key}", err <= rtol, f"relative error {err:.3g} > {rtol}")
        rep.check(
            f"{dtype} changed the result a little",
            any(not np.array_equal(got[k], plain[k]) for k in plain),
            "",
        )
    rep.raises(
        "bad comm_dtype",
        ValueError,
        lambda: pp.DDP(Linear(2, 2), world.group, comm_dtype="int8"),
        "comm_dtype",
    )


if __name__ == "__main__":
    run_rank(scenario)
