"""Rank worker for tests/transport/test_p2p.py (2 ranks): ``recv`` into a cupy array, with a stand-in cupy; and
``all_to_all`` of cupy arrays (staged through the host: NCCL does not run it).

No GPU is needed: the stand-in's array type is a numpy subclass whose type lives in module ``cupy``, which is
how the plane tells cupy arrays apart, so ``recv`` takes its device path (receive on the host, then copy in).
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import numpy as np

cupy = types.ModuleType("cupy")


class ndarray(np.ndarray):  # type: ignore[type-arg]
    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        return np.array(self.view(np.ndarray))

    @property
    def device(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


ndarray.__module__ = "cupy"
cupy.ndarray = ndarray  # type: ignore[attr-defined]
cupy.asarray = lambda a, dtype=None: np.array(a, dtype=dtype).view(ndarray)  # type: ignore[attr-defined]
cupy.empty_like = lambda a: np.empty_like(a).view(ndarray)  # type: ignore[attr-defined]
cupy.may_share_memory = np.may_share_memory  # type: ignore[attr-defined]
# What an asynchronous receive touches: the caller's stream, made current again on the copying thread.
cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
    get_current_stream=lambda: types.SimpleNamespace(ptr=0),
    ExternalStream=lambda _ptr: contextlib.nullcontext(),
)
sys.modules["cupy"] = cupy

from _common import Report, run_rank  # noqa: E402

import paramplane as pp  # noqa: E402


def scenario(world: Any, rep: Report) -> None:
    g = world.group
    for step, async_op in enumerate((False, True)):
        want = np.arange(5.0) + 10 * step
        if g.rank == 0:
            g.send(want, 1)
        else:
            x = np.zeros(5).view(ndarray)
            work = g.recv(x, 0, async_op=async_op)
            if async_op:
                work.wait()
            rep.check(f"recv into a cupy array (async_op={async_op})", type(x) is ndarray)
            rep.equal(f"received (async_op={async_op})", x.view(np.ndarray), want)
    blocks = (np.arange(6.0) + 100 * g.rank).view(ndarray)  # rank r sends rows 3j..3j+2 to rank j
    want = np.concatenate([np.arange(3.0) + 3 * g.rank + 100 * j for j in range(2)])
    got = g.all_to_all(blocks)
    rep.check("all_to_all of a cupy array gives a cupy array", type(got) is ndarray, str(type(got)))
    rep.equal("all_to_all of a cupy array", got.view(np.ndarray), want)
    out = np.zeros(6).view(ndarray)
    g.all_to_all(blocks, out=out, async_op=True).wait()
    rep.equal("all_to_all of a cupy array into out=", out.view(np.ndarray), want)


if __name__ == "__main__":
    assert pp.__name__ == "paramplane"  # imported after the stand-in took cupy's name
    run_rank(scenario)
