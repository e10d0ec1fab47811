"""AdamW state of ``pp.FSDP`` over tensor-parallel stages in checkpoints (4 ranks), against one process.

GPT-2 (4 blocks, float64, tied embedding/head) as one pipeline stage (pp 1), split over tp 2 by ``pp.parallelize``
and wrapped in ``pp.FSDP`` over dp 2, trains two AdamW steps and is saved: the model as the dense model's pieces
(gathered by ``summon_full_params``, as ``examples/train_gpt_3d.py`` saves it) and AdamW's state through
``pipe.optim_state(opt)`` (FSDP's pieces of tp pieces made whole and offered as pieces of the dense arrays).
One process trains the same four steps and saves the dense model and ``pp.tp_optim_state(model, opt)`` after
two. Then: the FSDP x tp save loads at dp 2 x pp 2 under ``pp.DDP`` (tp 1), and the one-process save loads into
FSDP over tp 2 stages again; each takes steps three and four, whose losses and parameters equal the one-process
run's (1e-9).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank
from pipeline_ckpt import LAYERS, MICROBATCHES, RTOL, STEPS, adamw, pipeline_step, unbroken_run

import paramplane as pp
from paramplane.parallel.sharding import ShardedArray


class Gathered:
    """A tensor-parallel stage under ``pp.FSDP`` as the dense model's pieces (its tp ``sharded_state_dict``
    inside ``summon_full_params``, copied): what the 3-D example saves."""

    def __init__(self, stage: Any, fsdp: Any) -> None:
        self.stage, self.fsdp = stage, fsdp

    def sharded_state_dict(self) -> dict[str, Any]:
        with self.fsdp.summon_full_params():
            return {
                k: ShardedArray(v.global_shape, v.start, v.local.copy())
                if isinstance(v, ShardedArray)
                else v.detach().clone()
                for k, v in self.stage.sharded_state_dict().items()
            }

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("load into the stage before wrapping it")


def tp_stage(mesh: pp.Mesh, model: Any) -> Any:
    """The whole model as one stage, split over tp, not yet wrapped."""
    stage = pp.pipeline_split(model, [])[0]
    pp.parallelize(stage, mesh.group("tp"), pp.tp_plan_for(stage))
    return stage


def scenario(world: Any, rep: Report, out: Path) -> None:
    ref_losses, ref_state = unbroken_run(world, out / "dense")

    # FSDP (dp 2) over tensor-parallel (tp 2) stages: two steps, saved.
    mesh = pp.Mesh(world, dp=2, pp=1, tp=2)
    stage = tp_stage(mesh, tm.build("gpt2", layers=LAYERS))
    fsdp = pp.FSDP(stage, mesh.group("dp"))
    pipe = pp.Pipeline(fsdp, mesh.group("pp"), "1f1b", MICROBATCHES, loss_fn=pp.causal_lm_loss)
    opt = adamw(fsdp.parameters())
    for step in range(2):
        rep.close(f"fsdp tp trained loss {step}", pipeline_step(mesh, pipe, step), ref_losses[step], RTOL)
        opt.step()
        opt.zero_grad(set_to_none=True)
    saved = {"model": Gathered(stage, fsdp), "optim": pipe.optim_state(opt), "step": 2}
    pp.checkpoint.save(saved, out / "fsdp_tp", world.group)
    arrays = pp.checkpoint.read_manifest(out / "fsdp_tp")["arrays"]
    dense = pp.checkpoint.read_manifest(out / "dense")["arrays"]
    moments = sorted(k for k in dense if k.startswith("optim/state."))
    mine = sorted(k for k in arrays if k.startswith("optim/state."))
    rep.check("the dense model's moment keys", moments == mine, str(sorted(set(moments) ^ set(mine))))
    for k in moments:
        rep.check(f"dense shape {k}", arrays.get(k, {}).get("global_shape") == dense[k]["global_shape"], k)

    # The FSDP x tp save at dp 2 x pp 2 under DDP (tp 1); the one-process save into FSDP over tp 2 stages.
    for name, saved_at in (("fsdp dp2 tp2 -> ddp dp2 pp2", "fsdp_tp"), ("dense -> fsdp dp2 tp2", "dense")):
        fresh = tm.build("gpt2", seed=1, layers=LAYERS)
        if saved_at == "fsdp_tp":
            mesh = pp.Mesh(world, dp=2, pp=2)
            stage = pp.pipeline_split(fresh, [2])[mesh.coordinate("pp")]
            pp.checkpoint.load({"model": stage}, out / saved_at, world.group)
            module = pp.DDP(stage, mesh.group("dp"))
        else:
            mesh = pp.Mesh(world, dp=2, pp=1, tp=2)
            stage = tp_stage(mesh, fresh)
            pp.checkpoint.load({"model": stage}, out / saved_at, world.group)
            module = pp.FSDP(stage, mesh.group("dp"))
        opt = adamw(module.parameters())
        pipe = pp.Pipeline(module, mesh.group("pp"), "1f1b", MICROBATCHES, loss_fn=pp.causal_lm_loss)
        got = pp.checkpoint.load({"optim": pipe.optim_state(opt), "step": 0}, out / saved_at, world.group)
        rep.check(f"{name} step", got["step"] == 2, str(got["step"]))
        counts = {float(s["step"]) for s in opt.state.values()}
        rep.check(f"{name} AdamW step count", counts == {2.0}, str(counts))
        for step in range(2, STEPS):
            rep.close(f"{name} loss {step}", pipeline_step(mesh, pipe, step), ref_losses[step], RTOL)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if isinstance(module, pp.FSDP):
            with module.summon_full_params():
                state = {k: v.clone() for k, v in pp.tp_full_state_dict(stage).items()}
        else:
            state = dict(stage.state_dict())
        for k in sorted(state):
            rep.close(f"{name} final {k}", state[k].detach().numpy(), ref_state[k], RTOL)
        rep.check(f"{name} holds parameters", len(state) > 4, str(len(state)))


if __name__ == "__main__":
    run_rank(lambda world, rep: scenario(world, rep, Path(sys.argv[1])))
