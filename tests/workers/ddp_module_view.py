"""pp.DDP (an nn.Module of its module's names) under torch.distributed.checkpoint (world 2, GPT-2).

``get_state_dict(model, opt)`` of pp.DDP after two AdamW steps equals that of torch's DDP (gloo) in the same
loop: the same model keys and values, the optimizer state under the same parameter names. A fresh pp.DDP (other
weights) and a fresh AdamW loaded from it through ``dcp.save`` / ``dcp.load`` and ``set_state_dict`` take one
more step equal to the unbroken run and to torch's DDP.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp


def _flat(state: dict[str, Any]) -> np.ndarray:
    return np.concatenate([v.double().reshape(-1).numpy() for v in state.values()])


def _optim_flat(osd: dict[str, Any]) -> dict[str, np.ndarray]:
    return {
        f"{name}/{key}": value.double().reshape(-1).numpy()
        for name, entry in osd["state"].items()
        for key, value in entry.items()
    }


def main(world: Any, rep: Report) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel

    tm.init_gloo(world)
    rank = world.rank

    def step(model: Any, opt: Any, i: int) -> None:
        model(**tm.batch("gpt2", i, rank)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ours = pp.DDP(tm.build("gpt2"), world.group)
    theirs = DistributedDataParallel(tm.build("gpt2"))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for i in range(2):
        for model, opt in zip((ours, theirs), opts, strict=True):
            step(model, opt, i)
    (msd, osd), (want_msd, want_osd) = (
        get_state_dict(m, o) for m, o in zip((ours, theirs), opts, strict=True)
    )
    rep.check(
        "get_state_dict: the model keys of torch's DDP", list(msd) == list(want_msd), str(list(msd))[:200]
    )
    rep.close("get_state_dict: the model values of torch's DDP", _flat(msd), _flat(want_msd), 1e-12)
    got, want = _optim_flat(osd), _optim_flat(want_osd)
    rep.check("get_state_dict: the optimizer state under torch's DDP's names", sorted(got) == sorted(want))
    rep.close(
        "get_state_dict: the optimizer state values",
        np.concatenate([got[k] for k in sorted(want)]),
        np.concatenate([want[k] for k in sorted(want)]),
        1e-12,
    )
    folder = Path(os.environ["PARAMPLANE_TEST_OUT"]) / "dcp"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)

    model = tm.build("gpt2")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # other weights: the load has to bring them
    fresh = pp.DDP(model, world.group)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    loaded_msd, loaded_osd = get_state_dict(fresh, fresh_opt)
    rep.check("the fresh model starts elsewhere", not np.allclose(_flat(loaded_msd), _flat(msd)))
    state = {"model": loaded_msd, "optim": loaded_osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for model, opt in ((ours, opts[0]), (fresh, fresh_opt), (theirs, opts[1])):
        step(model, opt, 2)
    after = _flat(ours.state_dict())
    rep.close("loaded through dcp, one more step = the unbroken run", _flat(fresh.state_dict()), after, 0.0)
    rep.close("... and = torch's DDP", after, _flat(theirs.module.state_dict()), 1e-12)


if __name__ == "__main__":
    run_rank(main)
