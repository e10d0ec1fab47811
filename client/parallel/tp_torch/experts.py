"""Expert parallel for a mixture of experts: the ``"experts"`` style of a ``pp.parallelize`` plan.

It applies to a module that holds every expert's weights as tensors whose first dimension is the expert
(transformers' fused ``MixtralExperts``, ``Qwen2MoeExperts``, ``OlmoeExperts``...: a ``num_experts`` attribute,
``forward(hidden_states, top_k_index, top_k_weights)``), over a group whose ranks hold different tokens (a
data-parallel group, as DeepSpeed-MoE and torchtitan place experts). Each rank keeps ``num_experts / n`` of the
experts (rank r the r-th block; ``TPShard`` on dimension 0, ``experts=True``). A forward:

1. sorts this rank's (token, choice) pairs by expert and exchanges how many go to each expert (one small
   ``all_to_all`` of counts);
2. sends each token's hidden state to the rank of each expert it chose (``all_to_all`` with split sizes);
3. runs the module's own forward, its experts now the local ones, on the tokens it received (each with its
   local expert and weight 1: the model's own expert code, whichever implementation it dispatches to);
4. sends each result back (the reverse split sizes) and sums every token's results times its router weights,
   as the module's own forward does.

Backward is the same two exchanges reversed (autograd Functions), so an expert's gradient on its rank sums the
contributions of every rank's tokens. Under ``pp.DDP`` over the same group, which averages every other gradient
over the group, the experts' are divided by the group's size instead of all-reduced (``ddp.py``), so a step
equals one process training the whole model on the whole batch.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.torch_params import to_array, to_tensor, torch_stream
from paramplane.parallel.tp_torch.state import TPShard

__all__ = ["ExpertParallel", "bind_experts", "check_experts", "expert_params", "expert_shard"]


@dataclass(frozen=True)
class ExpertParallel:
    """Split a fused experts module's experts over a group whose ranks hold different tokens."""


def expert_params(module: Any) -> list[tuple[str, Any]]:
    return list(module.named_parameters(recurse=False))


def check_experts(name: str, module: Any, n: int) -> None:
    """ValueError unless ``module`` is a fused experts module whose experts split over ``n`` ranks."""
    num = getattr(module, "num_experts", None)
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(
            f"ExpertParallel applies to a fused experts module (a num_experts attribute and each expert's "
            f"weights stacked along dimension 0, e.g. transformers' MixtralExperts); {name!r} is "
            f"{type(module).__name__}"
        )
    forward = getattr(type(module), "forward", None)
    try:
        takes = list(inspect.signature(forward).parameters)[1:] if forward is not None else []
    except (TypeError, ValueError):
        takes = []
    if len(takes) < 3:
        raise ValueError(
            f"ExpertParallel applies to a fused experts module whose forward takes (hidden_states, "
            f"top_k_index, top_k_weights); {name!r} ({type(module).__name__}) takes {takes}"
        )
    params = expert_params(module)
    if not params or any(p.dim() < 1 or p.shape[0] != num for _, p in params):
        shapes = {pname: tuple(p.shape) for pname, p in params}
        raise ValueError(
            f"ExpertParallel: {name!r} has num_experts={num} but its own parameters are {shapes}: each must "
            "stack the experts along dimension 0"
        )
    held = [c for c, sub in module.named_children() if next(sub.parameters(), None) is not None]
    if held:
        raise ValueError(
            f"ExpertParallel: {name!r} has submodules with parameters ({held}); only a module that holds its "
            "experts' weights itself is supported"
        )
    if num % n:
        raise ValueError(
            f"ExpertParallel: {name!r} has {num} experts, which do not split over {n} expert-parallel ranks"
        )


def expert_shard(module: Any, pname: str, group: ProcessGroup) -> TPShard:
    """How ``module``'s parameter ``pname`` is split: rank r keeps the r-th block of experts (dimension 0)."""
    return TPShard(tuple(getattr(module, pname).shape), 0, 1, group, experts=True)


def bind_experts(module: Any, group: ProcessGroup) -> None:
    """After its parameters were cut to this rank's experts: the local expert count and the dispatching
    forward."""
    num = int(module.num_experts)
    module.num_experts = num // group.size
    module.forward = types.MethodType(_forward(type(module).forward, group, num), module)


def _exchange(x: Any, send: list[int], recv: list[int], group: ProcessGroup) -> Any:
    """Rows of ``x``, ``send[j]`` of them to rank j, for the ``recv[j]`` rows each rank j sends here."""
    import torch

    x = x.detach().contiguous()
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    with torch_stream(x):
        group.all_to_all(
            to_array(x, "the tokens sent to the experts"),
            out=to_array(out, "the tokens received by the experts"),
            in_splits=send,
            out_splits=recv,
        )
    return out


_FUNCTION: Any = None


def _function() -> Any:
    global _FUNCTION
    if _FUNCTION is None:
        import torch

        class ExchangeRows(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any, send: list[int], recv: list[int], group: ProcessGroup) -> Any:
                ctx.send, ctx.recv, ctx.group = send, recv, group
                return _exchange(x, send, recv, group)

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None

        _FUNCTION = ExchangeRows
    return _FUNCTION


def _forward(experts_forward: Any, group: ProcessGroup, num: int) -> Any:
    n = group.size
    local = num // n

    def forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        import torch

        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        choice = top_k_index.reshape(-1)
        if top_k_index.shape[0] != x.shape[0]:
            raise ValueError(
                f"expert parallel: top_k_index has {top_k_index.shape[0]} rows for {x.shape[0]} tokens"
            )
        k = choice.numel() // max(1, x.shape[0])
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=num + 1)[: num + 1]  # index num: "no expert" (padding)
        routed = int(counts[:num].sum())
        order = order[:routed]  # ids >= num (some models' padding choice) go nowhere, as in their forward
        token = torch.div(order, k, rounding_mode="floor")
        table = counts[:num].reshape(n, local).to(torch.int64).contiguous()
        with torch_stream(table):
            got = to_tensor(group.all_to_all(to_array(table, "the experts' token counts")))
        send = table.sum(1).tolist()
        recv = got.sum(1).tolist()
        rows = _function().apply(x[token], send, recv, group)
        ids = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(n), got.reshape(-1).to(x.device)
        )
        ones = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=x.device)
        out = experts_forward(self, rows, ids.unsqueeze(1), ones)
        if rows.shape[0] == 0:
            # None of this rank's experts was chosen, and the module's own forward may not touch its input or
            # weights then: a zero term keeps both in the graph, so this rank's backward still runs both reverse
            # exchanges (every other rank runs them) and the experts still get a (zero) gradient, as the dense
            # module's stacked tensors do whenever any expert is chosen (AdamW then steps them alike).
            zero = sum((p.sum() * 0 for p in self.parameters(recurse=False)), rows.sum() * 0)
            out = out + zero.to(out.dtype)
        back = _function().apply(out, recv, send, group)
        weighted = back * top_k_weights.reshape(-1)[order, None]
        final = torch.zeros_like(x)
        final.index_add_(0, token, weighted.to(final.dtype))
        return final.reshape(shape)

    return forward
