"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B) and their executor."""

from __future__ import annotations

from paramplane.parallel.pipeline.runtime import Pipeline
from paramplane.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    build,
    gpipe_peak_activations,
    one_f_one_b_peak_activations,
    validate,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Pipeline",
    "build",
    "gpipe_peak_activations",
    "one_f_one_b_peak_activations",
    "validate",
]
