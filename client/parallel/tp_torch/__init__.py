"""Tensor parallel for torch modules: ``pp.parallelize(module, mesh.group("tp"), plan)`` (see ``plan.py``),
ready plans for transformers GPT-2 and Llama (``families.py``), vocabulary-parallel cross-entropy
(``loss.py``), Megatron's f/g mappings as autograd Functions (``comm.py``) and the dense / checkpoint views
of a split module (``state.py``), a torch optimizer's state as a checkpoint that reshards (``optim.py``). torch is imported only when a torch module is parallelised."""

from paramplane.parallel.tp_torch.families import tp_plan_for
from paramplane.parallel.tp_torch.loss import vocab_parallel_cross_entropy
from paramplane.parallel.tp_torch.optim import TPOptimState, tp_optim_state
from paramplane.parallel.tp_torch.plan import parallelize
from paramplane.parallel.tp_torch.state import TPShard, tp_full_state_dict
from paramplane.parallel.tp_torch.styles import (
    ColwiseParallel,
    ExpertParallel,
    RowwiseParallel,
    SequenceParallel,
    VocabParallel,
)

__all__ = [
    "ColwiseParallel",
    "ExpertParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "TPOptimState",
    "TPShard",
    "VocabParallel",
    "parallelize",
    "tp_full_state_dict",
    "tp_optim_state",
    "tp_plan_for",
    "vocab_parallel_cross_entropy",
]
