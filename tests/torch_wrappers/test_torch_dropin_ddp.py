"""pp.DDP over torch modules behaves as torch's DistributedDataParallel (issue 25, items 1 and 2).

Every rank checks in the worker (``tests/workers/dropin_ddp.py``); these tests launch the worlds and look at
what the ranks reported.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _world import run_example, run_world

import paramplane as pp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
import _torch_models as tm
import ddp_keywords as dk

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


class _TwoInputs(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x: Any, y: Any, *, scale: float = 1.0) -> dict[str, Any]:
        return {"out": (self.a(x) + self.b(y)) * scale, "scale": scale}


def test_forward_passes_every_argument_and_returns_the_output_unchanged(solo: pp.World) -> None:
    """Issue 25 item 1: ``ddp(x, y, scale=...)`` was a TypeError (the wrapper's forward took one input)."""
    model = _TwoInputs()
    ddp = pp.DDP(model, solo.group)
    x, y = torch.ones(5, 3), torch.ones(5, 4)
    got = ddp(x, y, scale=2.0)
    assert isinstance(got, dict) and got["scale"] == 2.0
    torch.testing.assert_close(got["out"], model(x, y, scale=2.0)["out"], rtol=0, atol=0)
    torch.testing.assert_close(ddp.forward(x, y=y)["out"], model(x, y)["out"], rtol=0, atol=0)
    ddp.remove_hooks()


def test_forward_decides_whether_its_backward_syncs_and_misuse_is_a_clear_error(solo: pp.World) -> None:
    """As torch's reducer: a forward inside ``no_sync`` makes its backward local even when the backward runs
    outside, and the reverse; ``attach`` stays valid (a no-op wait). Wrong arguments are ValueErrors."""
    model = _TwoInputs()
    ddp = pp.DDP(model, solo.group, find_unused_parameters=True)
    x, y = torch.ones(2, 3), torch.ones(2, 4)

    def issued() -> int:
        return int(solo.group._e.progress()[0])

    before = issued()
    with ddp.no_sync():
        out = ddp(x, y)["out"]
    out.sum().backward()
    assert issued() == before, "a backward of a no_sync forward communicated"
    out = ddp(x, y)["out"]
    with ddp.no_sync():
        out.sum().backward()
    after = issued()
    assert after > before, "a backward of a synchronised forward did not communicate"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp.attach(opt)
    opt.step()
    assert issued() == after, "attach's wait communicated again after backward's sync"
    with pytest.raises(ValueError, match=r"torch\.optim"):
        ddp.attach(pp.optim.SGD([pp.nn.Parameter(np.zeros(2))], lr=0.1))
    with pytest.raises(RuntimeError, match=r"loss\.backward"):
        ddp.backward(None)
    with pytest.raises(ValueError, match="find_unused_parameters"):
        pp.DDP(model, solo.group, find_unused_parameters="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gradient_as_bucket_view"):
        pp.DDP(model, solo.group, gradient_as_bucket_view=1)  # type: ignore[arg-type]
    ddp.remove_hooks()


def test_torch_ddp_keywords_are_accepted_and_checked(solo: pp.World) -> None:
    """``DDP(model, device_ids=[...], output_device=..., bucket_cap_mb=..., static_graph=...)`` as torch scripts
    write it, and torch 2.13's newer keywords: the devices must be the module's own (a CPU module takes None or
    "cpu"), ``bucket_cap_mb`` is the bucket size, one device per rank; what pp.DDP cannot honour and anything
    else wrong is a ValueError naming the problem."""
    ddp = pp.DDP(_TwoInputs(), solo.group, device_ids=["cpu"], output_device="cpu", bucket_cap_mb=2.0,
                 static_graph=True, dim=0, check_reduction=True, skip_all_reduce_unused_params=True,
                 batched_grad_copy=True, forward_sync_buffers=False)  # fmt: skip
    assert ddp.bucket_mb == 2.0 and not ddp.broadcast_buffers
    ddp.remove_hooks()
    for kwargs, words in (
        ({"device_ids": [0]}, "not the module's device"),  # a CUDA index for a CPU module
        ({"output_device": "cuda:1"}, "not the module's device"),
        ({"device_ids": ["cpu", "cpu"]}, "one device per rank"),
        ({"bucket_mb": 1.0, "bucket_cap_mb": 2.0}, "disagree"),
        ({"static_graph": "yes"}, "static_graph"),
        ({"forward_sync_buffers": 1}, "forward_sync_buffers must be a bool"),
        ({"dim": 1.0}, "dim must be an int"),
        ({"bucket_cap_mb_list": []}, "bucket_cap_mb_list"),
        ({"bucket_cap_mb_list": [1.0, 0]}, "bucket_cap_mb_list"),
        ({"mixed_precision": object()}, "torch.autocast"),
        (
            {"delay_all_reduce_named_params": [("a.weight", None)]},
            "delay_all_reduce_named_params not supported",
        ),
        ({"device_mesh": object()}, "pass a group .or process_group. or a device_mesh, not both"),
    ):
        with pytest.raises(ValueError, match=words):
            pp.DDP(_TwoInputs(), solo.group, **kwargs)


def test_parameter_and_state_dict_calls_take_torchs_arguments(solo: pp.World) -> None:
    """``named_parameters(prefix, recurse, remove_duplicate)``, ``parameters(recurse=)`` and
    ``state_dict(keep_vars=True)`` as torch code calls them on a module (they were TypeErrors); torch code that
    reads a module's internals reads its module's (pp.DDP is an nn.Module sharing them), and on pp.FSDP, which is
    not one, is told to pass ``.module``."""
    model = _TwoInputs()
    ddp = pp.DDP(model, solo.group)
    assert [n for n, _ in ddp.named_parameters("m", recurse=True)] == [
        f"m.{n}" for n, _ in model.named_parameters()
    ]
    assert [id(p) for p in ddp.parameters(recurse=True)] == [id(p) for p in model.parameters()]
    kept = ddp.state_dict(keep_vars=True)
    assert list(kept) == list(model.state_dict()) and all(
        v is p for v, p in zip(kept.values(), model.parameters())
    )
    # torch functions that take an nn.Module may read its internals
    assert ddp._non_persistent_buffers_set is model._non_persistent_buffers_set
    assert not hasattr(ddp, "_no_such_attribute")
    ddp.remove_hooks()
    fsdp = pp.FSDP(_TwoInputs(), solo.group)
    with pytest.raises(AttributeError, match=r"not a torch\.nn\.Module: pass its \.module"):
        _ = fsdp._non_persistent_buffers_set
    assert [n for n, _ in fsdp.named_parameters(prefix="f")] == [f"f.{n}" for n, _ in fsdp.named_parameters()]
    assert len(list(fsdp.parameters(recurse=False))) == len(list(fsdp.parameters()))


@pytest.mark.parametrize("wrapper", ["DDP", "FSDP"])
def test_torchs_sync_batchnorm_without_torch_distributed_is_refused_and_converts(
    solo: pp.World, wrapper: str
) -> None:
    """A script's ``torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)`` line kept as is: torch's layers need
    an initialised torch.distributed, and without one they normalise each rank's batch alone, silently; the
    wrappers refuse them, naming the layer and ``pp.convert_sync_batchnorm``, which converts them."""
    import torch.distributed as dist

    assert not dist.is_initialized()  # the situation of a script that replaced init_process_group by pp.init
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    )
    with pytest.raises(ValueError, match=r"'1' is torch's SyncBatchNorm.*pp\.convert_sync_batchnorm"):
        getattr(pp, wrapper)(model, solo.group)
    converted = pp.convert_sync_batchnorm(model, solo.group)
    assert isinstance(converted[1], pp.SyncBatchNorm)
    wrapped = getattr(pp, wrapper)(converted, solo.group)
    wrapped(torch.randn(5, 4)).sum().backward()


def test_bucket_cap_mb_list_gives_torchs_buckets(solo: pp.World) -> None:
    """``bucket_cap_mb_list`` (torch 2.13): each bucket its own limit, the last for every bucket after, as
    torch's ``_compute_bucket_assignment_by_size`` assigns the parameters in backward order."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    caps_mb = [0.01, 0.05, 0.02]
    ddp = pp.DDP(model, solo.group, bucket_cap_mb_list=caps_mb)
    params = list(model.parameters())
    theirs, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(params)), [int(c * 2**20) for c in caps_mb], [False] * len(params)
    )
    last = len(params) - 1
    assert [b.params for b in ddp._buckets] == [[last - j for j in bucket] for bucket in theirs]
    assert len(theirs) > len(caps_mb)  # the last limit served more than one bucket
    assert ddp.bucket_mb == max(caps_mb)
    ddp.remove_hooks()


class _Net(torch.nn.Module):  # type: ignore[misc]
    """Children, a parameter and a non-persistent buffer of the root's own, BatchNorm buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 2)
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: Any) -> Any:
        return self.head(self.bn(self.emb(x))) * self.scale


def test_ddp_of_a_torch_module_is_an_nn_module_under_the_modules_names(solo: pp.World) -> None:
    """As torch's DDP, pp.DDP of a torch module is a ``torch.nn.Module`` (code checks ``isinstance``, registers
    hooks on it, walks its modules, nests it in a larger module); every name it gives is its module's (the names
    of its ``state_dict``), moving it after wrapping and wrapping it again are refused."""
    model = _Net()
    ddp = pp.DDP(model, solo.group)
    assert isinstance(ddp, torch.nn.Module) and isinstance(ddp, pp.DDP)
    assert [n for n, _ in ddp.named_modules()] == [n for n, _ in model.named_modules()]
    assert [(n, id(b)) for n, b in ddp.named_buffers()] == [(n, id(b)) for n, b in model.named_buffers()]
    assert [n for n, _ in ddp.named_children()] == ["emb", "bn", "head"]
    assert ddp.get_submodule("bn") is model.bn and ddp.scale is model.scale
    assert ddp.eval() is ddp and not ddp.training and not any(m.training for m in model.modules())
    ddp.train()
    assert ddp.training and all(m.training for m in model.modules())
    # hooks on the wrapper run around its forward (a pre-hook may replace the arguments)
    seen: list[Any] = []
    pre = ddp.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    post = ddp.register_forward_hook(lambda m, args, out: seen.append((m, tuple(out.shape))))
    ddp.eval()
    out = ddp(torch.randn(5, 4))
    assert seen == [(ddp, (5, 2))]
    torch.testing.assert_close(out, model(torch.zeros(5, 4)))
    pre.remove()
    post.remove()
    grads_out: list[Any] = []
    back = ddp.register_full_backward_hook(
        lambda m, gi, go: grads_out.append((m, tuple(gi[0].shape), tuple(go[0].shape)))
    )
    ddp.train()
    ddp(torch.randn(5, 4, requires_grad=True)).sum().backward()
    assert grads_out == [(ddp, (5, 4), (5, 2))] and model.emb.weight.grad is not None
    back.remove()
    visited: list[Any] = []
    assert ddp.apply(visited.append) is ddp and visited == [*model.children(), model]
    # a child of a larger module: the plain model's keys and parameter names, strict loading both ways
    parent = torch.nn.Sequential(ddp, torch.nn.Linear(2, 2))
    plain = torch.nn.Sequential(_Net(), torch.nn.Linear(2, 2))
    assert list(parent.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in parent.named_parameters()] == [n for n, _ in plain.named_parameters()]
    parent.load_state_dict(plain.state_dict())
    torch.testing.assert_close(model.state_dict(), plain[0].state_dict(), rtol=0, atol=0)
    with torch.no_grad():
        model.scale.fill_(3.0)
    plain.load_state_dict(parent.state_dict())
    assert float(plain[0].scale.detach()) == 3.0
    # a move that changes nothing is accepted (as on torch's DDP), a real one refused
    assert ddp.to("cpu") is ddp and ddp.cpu() is ddp and ddp.to(torch.float32) is ddp
    assert ddp.to(torch.zeros(1), non_blocking=True) is ddp
    for name, move in (
        ("to", lambda: ddp.to(torch.float64)),
        ("to", lambda: ddp.to("meta")),
        ("to", lambda: ddp.to(memory_format=torch.channels_last)),
        ("double", ddp.double),
        ("cuda", ddp.cuda),
    ):
        with pytest.raises(RuntimeError, match=rf"^DDP\.{name}\(\): move or cast the module before wrapping"):
            move()
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    for wrap in (pp.DDP, pp.FSDP):
        with pytest.raises(ValueError, match=r"given a pp\.DDP wrapper: wrap the module itself, once"):
            wrap(ddp, solo.group)
    ddp.remove_hooks()


@pytest.mark.parametrize("wrapper", ["DDP", "FSDP"])
def test_copying_or_pickling_a_wrapper_is_a_clear_error(solo: pp.World, wrapper: str) -> None:
    """``copy.deepcopy(model)`` of a wrapped model (an EMA or teacher copy) and pickling were TypeErrors about
    ``__new__``'s arguments or a class lookup; they name the plain copy to take instead."""
    import copy
    import pickle

    wrapped = getattr(pp, wrapper)(_TwoInputs(), solo.group)
    plain = "ddp.module" if wrapper == "DDP" else r"fsdp.module\) inside fsdp.summon_full_params"
    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=rf"^pp\.{wrapper} holds a live group .* copy.deepcopy\({plain}"):
            attempt(wrapped)
    if wrapper == "DDP":
        twin = copy.deepcopy(wrapped.module)
        assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), wrapped.parameters(), strict=True))
        wrapped.remove_hooks()


@pytest.mark.parametrize("wrapper", ["DDP", "FSDP"])
def test_the_group_is_positional_or_torchs_process_group_keyword(solo: pp.World, wrapper: str) -> None:
    """torch's ``process_group=`` names the group as the positional argument does; no group, two different
    ones, FSDP1's (intra, inter) pair or a torch process group are ValueErrors saying what to pass."""
    wrap = getattr(pp, wrapper)
    for args in ((), (solo.group,)):
        wrapped = wrap(_TwoInputs(), *args, process_group=solo.group)
        assert wrapped.group is solo.group
        x, y = torch.ones(2, 3), torch.ones(2, 4)
        wrapped(x, y)["out"].sum().backward()  # a step runs over it
    other = solo.new_group([0])
    assert other is not None and other is not solo.group
    for kwargs, words in (
        ({}, "needs a group: pass world.group"),
        ({"group": solo.group, "process_group": other}, "different groups"),
        ({"process_group": (solo.group, other)}, "intra_size"),
        ({"process_group": object()}, "needs a ProcessGroup, got object"),
        ({"group": [0]}, "torch's DDP takes device_ids there"),  # DDP(model, [local_rank]), torch's call
    ):
        with pytest.raises(ValueError, match=words):
            wrap(_TwoInputs(), **kwargs)


def test_grads_are_averaged_when_backward_returns_so_clipping_holds() -> None:
    """Issue 25 item 2: with the standard loop (``clip_grad_norm_`` between backward and step), ``.grad`` was
    this rank's own when backward returned and the attached optimizer's sync overwrote the clipped values."""
    results = run_world(2, "dropin_ddp.py", args=["issue"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90)
    out = results.check_ok(min_checks=12)
    assert out[0]["digests"] == out[1]["digests"]


# world size -> every rank's env (world 2 on shared memory, world 3 over gRPC)
WORLDS = {2: {"PARAMPLANE_TRANSPORT": "shm"}, 3: {"PARAMPLANE_TRANSPORT": "grpc"}}


@pytest.mark.timeout(210)  # its own bounds (150 s), not the global 120 s
@pytest.mark.parametrize("num_ranks", sorted(WORLDS), ids=lambda n: f"world{n}")
def test_standard_loop_on_third_party_models_matches_one_process_and_torch_ddp(num_ranks: int) -> None:
    """GPT-2, Llama and ResNet from transformers (and torchvision's ResNet-18: one positional input, logits out)
    with the standard torch loop (kwargs in, ModelOutput out,
    clipping, AdamW param groups, LR scheduler) equal one process and torch's DDP over gloo every step; then
    no_sync, unused submodules, positional and keyword arguments, and bfloat16 autocast in the same world."""
    env = {"PARAMPLANE_TIMEOUT": "60", **WORLDS[num_ranks]}
    out = run_world(num_ranks, "dropin_ddp.py", args=["models"], env=env, timeout=150).check_ok(min_checks=60)
    assert all(r["digests"] == out[0]["digests"] for r in out), "ranks ended with different parameters"
    assert set(tm.MODELS) <= set(out[0]["digests"]), "a model did not train"


def test_nanogpt_accumulation_flag_and_the_modules_attributes_through_the_wrapper() -> None:
    """nanoGPT's loop sets ``model.require_backward_grad_sync`` per micro-step (it used to be ignored: every
    micro-step all-reduced): the micro-steps' backwards stay local as with torch's DDP, and the parameters equal
    one process; ``config``, ``named_modules``, ``training`` and ``generate`` reach the module, methods that
    return it return the wrapper, and moving the model after wrapping is refused."""
    out = run_world(2, "dropin_loop.py", args=["ddp"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90).check_ok(
        min_checks=23
    )
    assert out[0]["digests"] == out[1]["digests"]


def test_host_buckets_hand_their_buffers_to_the_gradients_with_torch_ddp_semantics() -> None:
    """The default (``gradient_as_bucket_view=False``) on CPU holds gradients once: each bucket's buffer
    becomes the gradients after a synchronised backward and the next round takes a new one. Over no_sync,
    set_to_none=True/False and accumulation across synchronised steps the gradients equal one process and
    torch's DDP, and gradients kept from an earlier step are never overwritten."""
    out = run_world(2, "ddp_grad_storage.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90).check_ok(
        min_checks=21
    )
    assert out[0]["digests"] == out[1]["digests"]


def test_end_of_backward_runs_once_per_outermost_backward_and_after_a_raised_one() -> None:
    """The wrappers' end-of-backward callback: once per backward, also when a reentrant checkpoint runs nested
    backwards inside it (each requesting), and again in the next backward after one that raised (the wrappers
    reset it at each forward)."""
    from torch.utils.checkpoint import checkpoint

    from paramplane.parallel.torch_params import EndOfBackward

    runs: list[int] = []
    end = EndOfBackward(lambda: runs.append(1))

    def requesting(t: Any) -> Any:
        if t.requires_grad:  # not in a reentrant checkpoint's first (no-grad) forward
            t.register_hook(lambda g: (end.request(), g)[1])
        return t

    x = torch.ones(3, requires_grad=True)
    requesting(x * 2).sum().backward()
    assert runs == [1]

    def block(t: Any) -> Any:
        return requesting(t * 3)

    out = requesting(checkpoint(block, requesting(x * 2), use_reentrant=True))
    out.sum().backward()  # the block's backward is a nested graph task that requests too
    assert runs == [1, 1] and x.grad is not None

    def fail(g: Any) -> Any:
        end.request()
        raise RuntimeError("a hook failed")

    y = x * 2
    y.register_hook(fail)
    with pytest.raises(RuntimeError, match="a hook failed"):
        y.sum().backward()
    assert runs == [1, 1]  # the failed backward's callback never ran
    end.reset()  # the next forward
    requesting(x * 2).sum().backward()
    assert runs == [1, 1, 1]


def test_join_trains_uneven_inputs_as_torch_ddp_join() -> None:
    """``with ddp.join():`` with 2, 4 and 3 steps on ranks 0-2 (an MLP, and one with BatchNorm buffers; both
    divisors): every rank ends with torch's DDP ``join()`` results over gloo and, for the MLP, with one process
    stepping on the batches of the ranks still training (before, a rank that ran out made the others fail with
    PeerLost)."""
    out = run_world(3, "ddp_join.py", args=["uneven"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=120)
    results = out.check_ok(min_checks=7)
    assert len(results[0]["digests"]) == 4
    assert all(r["digests"] == results[0]["digests"] for r in results), "ranks ended with different states"


def test_join_throw_on_early_termination_raises_on_every_rank() -> None:
    out = run_world(3, "ddp_join.py", args=["throw"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90)
    out.check_ok(min_checks=2)


def test_unfrozen_lazy_and_sparse_parameters_are_refused_and_torch_compression_hooks_work() -> None:
    """GPT-2 under pp.DDP and pp.FSDP: a parameter frozen at wrap time and unfrozen later used to get rank-local
    gradients silently (neither wrapper synchronises it, as torch's); its backward now raises naming it, while
    freezing after wrapping trains as one process. A lazy module and ``sparse=True`` embeddings are ValueErrors
    at wrap time (they failed deep inside a view or at the first backward). torch's compression hooks through
    ``register_comm_hook`` compress the all-reduce: fp16's gradients equal torch's DDP with the same hook (gloo). A module wrapped twice:
    ``DDP(ddp.module)`` takes over the older wrapper's hooks; wrappers over a pp.FSDP's module are ValueErrors."""
    out = run_world(2, "wrap_checks.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=120)
    out.check_ok(min_checks=24)


@pytest.mark.parametrize("mode", ["buffers", "mesh"])
def test_torch_2_13_buffer_keywords_and_device_meshes_behave_as_torchs(mode: str) -> None:
    """``buffers``: ``broadcast_buffers`` / ``forward_sync_buffers`` broadcast BatchNorm statistics when torch
    2.13's DDP does (ranks starting apart), the keywords that change nothing here change nothing: parameters and
    buffers equal torch's DDP over gloo. ``mesh``: ``device_mesh=`` (over paramplane's torch.distributed
    backend) for pp.DDP (1-D, equal to torch's DDP on it) and pp.FSDP (1-D, and 2-D for HYBRID_SHARD), equal to
    one process; wrong meshes are ValueErrors."""
    out = run_world(2, "ddp_keywords.py", args=[mode], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=150)
    out.check_ok(min_checks=len(dk.CONFIGS) + 1 if mode == "buffers" else 12)


def test_a_torch_optimizer_under_ddp_checkpoints_by_name_and_loads_under_ddp_and_fsdp() -> None:
    """``ddp.optim_state(opt)`` in a checkpoint (GPT-2, torch's AdamW, world 2) loads into fresh pp.DDP and
    pp.FSDP wrappers with fresh optimizers, where one more step equals one process; a bare torch optimizer is a
    CheckpointError naming ``optim_state`` (it was a JSON error about a tensor)."""
    out = run_world(2, "ddp_optim_checkpoint.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=150)
    out.check_ok(min_checks=8)


@pytest.mark.timeout(240)
def test_the_torch_ddp_example_learns_and_resumes_to_the_parameters_of_an_unbroken_run(
    tmp_path: Path,
) -> None:
    """``examples/train_torch_ddp.py`` (a torch DDP script ported line by line: DistributedSampler, DataLoader,
    BatchNorm, AdamW with a cosine schedule, clipping, checkpoints of ``ddp.optim_state(opt)`` and the
    scheduler) on 2 ranks: it learns the digits (well above chance), and a run interrupted after epoch 1 and
    resumed ends with the digest of the parameters and buffers of a run that never stopped."""
    pytest.importorskip("sklearn")
    full = run_example(
        "train_torch_ddp.py", 2, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "a"),
        "--digest", str(tmp_path / "a.sha"), timeout=120,
    )  # fmt: skip
    accuracy = re.search(r"final test accuracy ([0-9.]+)", full)
    assert accuracy is not None and float(accuracy.group(1)) > 0.5, full[-1000:]  # 10 classes: chance is 0.1
    common = ("--epochs", "2", "--checkpoint-dir", str(tmp_path / "b"))
    run_example("train_torch_ddp.py", 2, *common, "--stop-after", "1", timeout=120)
    resumed = run_example("train_torch_ddp.py", 2, *common, "--resume", "--digest", str(tmp_path / "b.sha"))
    assert "resumed from" in resumed and "epoch_001" in resumed, resumed[-1000:]
    assert (tmp_path / "b.sha").read_text() == (tmp_path / "a.sha").read_text()


def test_torch_distributed_checkpoint_takes_ddp_as_torchs_ddp() -> None:
    """``torch.distributed.checkpoint.state_dict.get_state_dict(ddp, opt)`` (it took only ``ddp.module``) gives
    what it gives for torch's DDP in the same GPT-2 loop (keys, values, optimizer state by name); ``dcp.save`` /
    ``dcp.load`` and ``set_state_dict`` into a fresh pp.DDP and AdamW resume to the unbroken run's next step."""
    out = run_world(2, "ddp_module_view.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=150)
    out.check_ok(min_checks=7)
