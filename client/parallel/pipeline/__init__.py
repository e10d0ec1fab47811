"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B) and their executor, over\n``paramplane.nn`` stages or torch ones (``pipeline_split`` cuts a torch transformer into stages)."""

from __future__ import annotations

from paramplane.parallel.pipeline.optim_state import PipelineOptimState, pipeline_optim_state
from paramplane.parallel.pipeline.runtime import Pipeline
from paramplane.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    build,
    gpipe_peak_activations,
    one_f_one_b_peak_activations,
    validate,
)
from paramplane.parallel.pipeline.split import StageInfo, causal_lm_loss, pipeline_split

__all__ = [
    "SCHEDULES",
    "Action",
    "Pipeline",
    "PipelineOptimState",
    "StageInfo",
    "build",
    "causal_lm_loss",
    "gpipe_peak_activations",
    "one_f_one_b_peak_activations",
    "pipeline_optim_state",
    "pipeline_split",
    "validate",
]
