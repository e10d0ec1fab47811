"""FSDP over data-parallel replicas inside a pipeline of torch stages (dp 2 x pp 2 on 4 ranks) against one process.

Each rank's GPT-2 stage (``pp.pipeline_split``, the tied embedding/head on the first and last stage) is wrapped
in ``pp.FSDP`` over the dp group and run by ``pp.Pipeline`` with microbatches; AdamW steps the shards once per
global batch after ``Pipeline.clip_grad_norm_``. Per schedule (GPipe with a unit per block: every forward
before every backward; 1F1B with the default units; interleaved 1F1B over two chunks per rank) every step's
loss and clipped gradient norm and the final parameters equal one process on the whole batch (float64, 1e-9),
and the gradients were reduced once per step, not once per microbatch (the dp group's collectives counted: a
reduce-scatter per unit, and the tied weight's own all-reduce).
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

STEPS, MICROBATCHES, ROWS = 2, 4, 16  # ROWS: the global batch; 2 rows per microbatch on each replica
CLIP = 0.3  # below the gradient norms here: every step clips (checked)
RTOL = 1e-9
CASES = (
    ("gpipe", 2, True),
    ("1f1b", 2, False),
    ("interleaved_1f1b", 4, True),
)  # schedule, layers, unit/block


def batch(step: int) -> dict[str, Any]:
    """Left padding in every other row: each microbatch of two rows counts as many tokens as any other."""
    return tm.left_padded_batch(100 + step, ROWS)


class Counting:
    """Counts the reductions a group starts (wrapping its all_reduce / reduce_scatter), per kind."""

    def __init__(self, group: Any) -> None:
        self.calls = {"all_reduce": 0, "reduce_scatter": 0}
        for name in self.calls:
            inner = getattr(group, name)
            setattr(group, name, self._counted(name, inner))

    def _counted(self, name: str, inner: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return inner(*args, **kwargs)

        return call


def run_case(world: Any, rep: Report, schedule: str, layers: int, per_block: bool) -> None:
    import torch

    mesh = pp.Mesh(world, dp=2, pp=2)
    dp, p = mesh.group("dp"), mesh.group("pp")
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    n = p.size * chunks
    model = tm.build("gpt2", layers=layers)
    stages = pp.pipeline_split(model, [layers * s // n for s in range(1, n)])[p.rank :: p.size]
    units = pp.units_by_class(tm.block_class(model)) if per_block else None
    wrapped = [pp.FSDP(s, dp, units=units) for s in stages]
    counters = [Counting(g) for g in {id(w.shard_group): w.shard_group for w in wrapped}.values()]
    pipe = pp.Pipeline(
        wrapped if chunks > 1 else wrapped[0], p, schedule, MICROBATCHES, loss_fn=pp.causal_lm_loss
    )
    opt = torch.optim.AdamW([q for w in wrapped for q in w.parameters()], lr=1e-2, weight_decay=0.1)
    ref = tm.build("gpt2", layers=layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    rows = ROWS // dp.size
    loss_sum = np.zeros(1)
    for step in range(STEPS):
        b = batch(step)
        mine = {k: v[dp.rank * rows : (dp.rank + 1) * rows] for k, v in b.items()}
        for c in counters:
            c.calls = dict.fromkeys(c.calls, 0)
        losses = pipe.step(
            mine["input_ids"] if pipe.is_first else None,
            target=mine["labels"] if pipe.is_last else None,
            attention_mask=mine["attention_mask"],
        )
        # one reduce-scatter per FSDP unit per step, whatever the number of microbatches, and one all-reduce
        # of the tied embedding/head (each rank holds one copy), reduced on its own so the copies stay equal
        want_calls = {"all_reduce": 1, "reduce_scatter": sum(len(w.units) for w in wrapped)}
        calls = {k: sum(c.calls[k] for c in counters) for k in want_calls}
        rep.check(f"{schedule} reductions {step}", calls == want_calls, f"{calls} != {want_calls}")
        norm = float(pipe.clip_grad_norm_(CLIP))
        opt.step()
        opt.zero_grad(set_to_none=True)
        want, want_norm = tm.clipped_reference_step(ref, ref_opt, b, CLIP)
        rep.check(f"{schedule} clipped {step}", want_norm > CLIP, f"norm {want_norm} does not clip")
        rep.close(f"{schedule} grad norm {step}", norm, want_norm, RTOL)
        loss_sum[0] = np.mean(losses) if losses is not None else 0.0
        mesh.group(("pp", "dp")).all_reduce(loss_sum, "sum")  # the last stage's replicas: their mean
        rep.close(f"{schedule} loss {step}", loss_sum[0] / dp.size, want, RTOL)
    ref_state = ref.state_dict()
    for w in wrapped:
        for k, v in w.state_dict().items():
            rep.close(f"{schedule} final {k}", v.detach().numpy(), ref_state[k].detach().numpy(), RTOL)


def scenario(world: Any, rep: Report) -> None:
    for schedule, layers, per_block in CASES:
        run_case(world, rep, schedule, layers, per_block)
    # A stage wrapped in FSDP must not also get a dp_group (its group is the dp group).
    mesh = pp.Mesh(world, dp=2, pp=2)
    stage = pp.pipeline_split(tm.build("gpt2"), [1])[mesh.coordinate("pp")]
    fsdp = pp.FSDP(stage, mesh.group("dp"))
    rep.raises(
        "dp_group beside FSDP",
        ValueError,
        lambda: pp.Pipeline(fsdp, mesh.group("pp"), "1f1b", 2, dp_group=mesh.group("pp")),
        "leave out dp_group",
    )


if __name__ == "__main__":
    run_rank(scenario)
