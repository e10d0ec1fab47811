"""3-D parallel training of transformers GPT-2 (dp x pp x tp on one ``pp.Mesh``) against one process.

Usage: ``pipeline_3d.py DP PP TP OUT [LOAD LDP LPP LTP]``: the world trains three steps with tensor parallel
inside the pipeline stages (``pp.parallelize`` with ``pp.tp_plan_for``), ``pp.DDP`` over dp, 1F1B over pp,
AdamW with clipping (``Pipeline.clip_grad_norm_``); every step's loss and gradient norm and the final dense
parameters equal one process on the whole batch. It saves the model to ``OUT``. With ``LOAD`` (a checkpoint
written by such a run at another factorisation) a fresh dense model loads it and, cut and split on a mesh
``LDP x LPP x LTP`` of the same world, must equal the reference after three steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp

STEPS, MICROBATCHES, ROWS = 3, 2, 8  # the global batch is the same at every factorisation
CLIP = 0.5  # below the gradient norms here: every step clips (checked)
RTOL = 1e-9
LAYERS = 4  # every factorisation cuts the same model


def batch(step: int, rows: int = ROWS) -> dict[str, Any]:
    """The global batch of ``step`` (every microbatch of an even number of rows counts as many tokens,
    whatever the factorisation)."""
    return tm.left_padded_batch(step, rows)


def build_pipeline(mesh: pp.Mesh, schedule: str = "1f1b", model: Any = None) -> tuple[Any, list[Any]]:
    """``model`` (default: a fresh one) cut into pp stages, this rank's stage split over tp and wrapped in
    pp.DDP over dp."""
    layers = LAYERS
    model = tm.build("gpt2", layers=layers) if model is None else model
    n = mesh.size("pp")
    stages = pp.pipeline_split(model, [layers * s // n for s in range(1, n)])
    stage = stages[mesh.coordinate("pp")]
    if mesh.size("tp") > 1:
        pp.parallelize(stage, mesh.group("tp"), pp.tp_plan_for(stage))
    wrapped = pp.DDP(stage, mesh.group("dp")) if mesh.size("dp") > 1 else stage
    pipe = pp.Pipeline(wrapped, mesh.group("pp"), schedule, MICROBATCHES, loss_fn=pp.causal_lm_loss)
    return pipe, [stage]


def dense(stage: Any) -> dict[str, np.ndarray]:
    state = stage.full_state_dict() if hasattr(stage, "full_state_dict") else stage.state_dict()
    return {k: v.detach().numpy() for k, v in state.items()}


def train(
    world: Any, rep: Report, dims: list[int], out: Path, load: Path | None, load_dims: list[int]
) -> None:
    import torch

    dp, p, tp = dims
    mesh = pp.Mesh(world, dp=dp, pp=p, tp=tp)
    pipe, mine = build_pipeline(mesh)
    opt = torch.optim.AdamW([q for s in mine for q in s.parameters()], lr=1e-2, weight_decay=0.1)
    ref = tm.build("gpt2", layers=LAYERS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    rows = ROWS
    d = mesh.coordinate("dp")
    loss_sum = np.zeros(1)
    for step in range(STEPS):
        b = batch(step, rows)
        mine_rows = {k: v[d * rows // dp : (d + 1) * rows // dp] for k, v in b.items()}
        losses = pipe.step(
            mine_rows["input_ids"] if pipe.is_first else None,
            target=mine_rows["labels"] if pipe.is_last else None,
            attention_mask=mine_rows["attention_mask"],
        )
        norm = float(pipe.clip_grad_norm_(CLIP))
        opt.step()
        opt.zero_grad(set_to_none=True)
        want, want_norm = tm.clipped_reference_step(ref, ref_opt, b, CLIP)
        rep.close(f"grad norm {step}", np.array(norm), np.array(want_norm), RTOL)
        rep.check(f"clipped {step}", want_norm > CLIP, f"norm {want_norm} does not clip")
        loss_sum[0] = np.mean(losses) if losses is not None else 0.0
        mesh.group(("pp", "dp")).all_reduce(loss_sum, "sum")  # the last stage's replicas: their mean
        rep.close(f"loss {step}", loss_sum[0] / dp, want, RTOL)
    ref_state = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    for s in mine:
        for k, v in dense(s).items():
            rep.close(f"final {k}", v, ref_state[k], RTOL)
    pp.checkpoint.save({"model": mine[0], "step": STEPS}, out, world.group)
    if load is not None:
        # The checkpoint holds the dense model under its own names: every rank loads it into a fresh dense
        # model, then cuts and splits that at the other factorisation.
        fresh = tm.build("gpt2", seed=1, layers=LAYERS)
        got = pp.checkpoint.load({"model": fresh, "step": 0}, load, world.group)
        rep.check("loaded step", got["step"] == STEPS, str(got["step"]))
        other = pp.Mesh(world, dp=load_dims[0], pp=load_dims[1], tp=load_dims[2])
        _, fresh_mine = build_pipeline(other, "gpipe", fresh)  # 1f1b needs as many microbatches as stages
        for k, v in dense(fresh_mine[0]).items():
            rep.close(f"loaded {k}", v, ref_state[k], RTOL)


def main() -> None:
    dims = [int(a) for a in sys.argv[1:4]]
    out = Path(sys.argv[4])
    load = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    load_dims = [int(a) for a in sys.argv[6:9]]
    run_rank(lambda world, rep: train(world, rep, dims, out, load, load_dims))


if __name__ == "__main__":
    main()
