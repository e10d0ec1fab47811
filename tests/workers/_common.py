"""Helpers shared by the rank workers: deterministic per-rank data, references, and the result file.

Every rank can compute every other rank's input (the generator is seeded by rank and tag), so
each rank checks its own output against a numpy reference without any extra communication.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bfloat16": BF16,
    "int64": np.dtype(np.int64),
}
RTOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2e-2}
_UFUNCS = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


def is_int(dtype: np.dtype[Any]) -> bool:
    return dtype.kind in "iu"


def data(rank: int, tag: str, dtype: np.dtype[Any], shape: tuple[int, ...], op: str = "sum") -> np.ndarray:
    """Rank ``rank``'s input for check ``tag``: ints small (exact products), floats in [0.5, 2)."""
    rng = np.random.default_rng(zlib.crc32(f"{tag}|{rank}".encode()))
    if is_int(dtype):
        hi = 3 if op == "product" else 50
        return rng.integers(-hi, hi + 1, size=shape).astype(dtype)
    return rng.uniform(0.5, 2.0, size=shape).astype(np.float32).astype(dtype)


def reference(inputs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """The reduction of ``inputs`` (exact for ints, min and max; float64 for float sums/products)."""
    dtype = inputs[0].dtype
    exact = is_int(dtype) or op in ("min", "max")
    acc = inputs[0].copy() if exact else inputs[0].astype(np.float64)
    for x in inputs[1:]:
        _UFUNCS[op](acc, x if exact else x.astype(np.float64), out=acc)
    if op == "mean":
        acc = acc / len(inputs)
    return acc


def digest(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:16]


class Report:
    """Collects check outcomes and writes ``$PARAMPLANE_TEST_OUT/rank-<r>.json``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []
        self.num_checks = 0
        self.digests: dict[str, str] = {}
        self.values: dict[str, Any] = {}

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.num_checks += 1
        if not ok:
            self.failures.append(f"{name}: {detail}")
        return ok

    def equal(self, name: str, got: Any, want: np.ndarray, *, rtol: float | None = None) -> bool:
        """``got`` equals ``want`` (exactly, or within ``rtol`` when given) with ``want``'s shape."""
        if not isinstance(got, np.ndarray):
            return self.check(name, False, f"got {type(got).__name__}, want an array")
        if got.shape != want.shape:
            return self.check(name, False, f"shape {got.shape}, want {want.shape}")
        if rtol is None:
            same = got.dtype == want.dtype and np.array_equal(got, want)
            return self.check(
                name, bool(same), f"not exactly equal: got {got.ravel()[:4]} want {want.ravel()[:4]}"
            )
        g, w = got.astype(np.float64), want.astype(np.float64)
        err = np.abs(g - w) / np.maximum(np.abs(w), 1e-30)
        worst = float(err.max()) if err.size else 0.0
        return self.check(name, worst <= rtol, f"relative error {worst:.3g} > {rtol:g}")

    def close(self, name: str, got: Any, want: Any, rtol: float) -> bool:
        """``max|got - want| <= rtol * max|want|`` with ``want``'s shape (elementwise relative error means nothing
        for entries that are zero in exact arithmetic, such as attention key biases AdamW moves by rounding)."""
        g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if g.shape != w.shape:
            return self.check(name, False, f"shape {g.shape}, want {w.shape}")
        err = float(np.abs(g - w).max(initial=0.0)) / max(float(np.abs(w).max(initial=0.0)), 1e-300)
        return self.check(name, err <= rtol, f"relative error {err:.3g} > {rtol:g}")

    def raises(self, name: str, exc_type: type[BaseException], fn: Callable[[], Any], *needles: str) -> Any:
        """``fn()`` raises ``exc_type`` whose text contains every needle; returns the exception."""
        try:
            fn()
        except exc_type as exc:
            text = str(exc)
            missing = [s for s in needles if s not in text]
            self.check(name, not missing, f"{exc_type.__name__} text {text!r} lacks {missing}")
            return exc
        except BaseException as exc:
            self.check(name, False, f"raised {type(exc).__name__}: {exc}, want {exc_type.__name__}")
            return exc
        self.check(name, False, f"did not raise {exc_type.__name__}")
        return None

    def write(self) -> None:
        out = Path(os.environ["PARAMPLANE_TEST_OUT"]) / f"rank-{self.rank}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "rank": self.rank,
                    "num_checks": self.num_checks,
                    "failures": self.failures,
                    "digests": self.digests,
                    "values": self.values,
                    "time": time.time(),
                }
            )
        )
        tmp.replace(out)


def run_rank(scenario: Callable[[Any, Report], None]) -> None:
    """Join the world and run ``scenario(world, report)``; an unexpected exception becomes a failure
    and the report is written either way."""
    import paramplane as pp

    report = Report(int(os.environ["PARAMPLANE_RANK"]))
    try:
        with pp.init() as world:
            report.rank = world.rank
            report.values["job_id"] = world.job_id
            scenario(world, report)
    except BaseException as exc:
        report.failures.append(f"unexpected {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        report.write()
