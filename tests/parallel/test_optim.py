"""paramplane.optim: update rules by hand and against torch.optim, state dicts, hooks, training."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from paramplane import nn, optim
from paramplane.node.arrays import cupy_module

Arr = np.ndarray[Any, Any]


def scalar_param(value: float) -> nn.Parameter:
    return nn.Parameter(np.array([value]))


def run_steps(opt: optim.Optimizer, grads: list[list[Arr]]) -> None:
    for step_grads in grads:
        for p, g in zip(opt.params, step_grads):
            p.grad = g.copy()
        opt.step()


def test_sgd_matches_hand_worked_steps() -> None:
    # lr 0.1, momentum 0.9, constant grad 1 from p=1: buf 1, 1.9, 2.71 -> p 0.9, 0.71, 0.439
    p = scalar_param(1.0)
    run_steps(optim.SGD([p], lr=0.1, momentum=0.9), [[np.ones(1)]] * 3)
    np.testing.assert_allclose(p.data, [0.439], rtol=1e-12)
    # nesterov: d = g + 0.9 * buf: 1.9 then 1 + 0.9 * 1.9 = 2.71 -> p 0.81, 0.539
    p = scalar_param(1.0)
    run_steps(optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True), [[np.ones(1)]] * 2)
    np.testing.assert_allclose(p.data, [0.539], rtol=1e-12)
    # weight decay 0.1: d = 1 + 0.1 * p: 1.1 -> p 0.89; 1.089 -> p 0.7811
    p = scalar_param(1.0)
    run_steps(optim.SGD([p], lr=0.1, weight_decay=0.1), [[np.ones(1)]] * 2)
    np.testing.assert_allclose(p.data, [0.7811], rtol=1e-12)
    # dampening 0.5: buf 1, then 0.9 + 0.5 = 1.4 -> p 0.9, 0.76
    p = scalar_param(1.0)
    run_steps(optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.5), [[np.ones(1)]] * 2)
    np.testing.assert_allclose(p.data, [0.76], rtol=1e-12)


def test_adamw_matches_hand_worked_steps() -> None:
    # Constant grad 2, lr 0.1, wd 0.5: bias-corrected m_hat = 2 and v_hat = 4 on every step, so each
    # step is p <- p * (1 - 0.05) - 0.1 * 2 / (2 + eps): 1 -> 0.85 -> 0.7075.
    p = scalar_param(1.0)
    opt = optim.AdamW([p], lr=0.1, weight_decay=0.5, eps=0.0)
    run_steps(opt, [[np.full(1, 2.0)]])
    np.testing.assert_allclose(p.data, [0.85], rtol=1e-12)
    run_steps(opt, [[np.full(1, 2.0)]])
    np.testing.assert_allclose(p.data, [0.7075], rtol=1e-12)
    assert opt.state[0]["step"] == 2
    np.testing.assert_allclose(opt.state[0]["exp_avg"], [0.38], rtol=1e-12)  # 0.9 * 0.2 + 0.1 * 2
    np.testing.assert_allclose(opt.state[0]["exp_avg_sq"], [0.007996], rtol=1e-12)  # .999 * .004 + .004


def sgd_reference(
    p: Arr, grads: list[Arr], lr: float, momentum: float, wd: float, nesterov: bool, damp: float
) -> Arr:
    p, buf = p.copy(), None
    for g in grads:
        d = g + wd * p
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + (1 - damp) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
    return p


def adamw_reference(p: Arr, grads: list[Arr], lr: float, b1: float, b2: float, eps: float, wd: float) -> Arr:
    p, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


SGD_CONFIGS = [
    {"lr": 0.1},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"lr": 0.02, "momentum": 0.5, "dampening": 0.3, "weight_decay": 0.1},
]
ADAMW_CONFIGS = [
    {},
    {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    {"lr": 0.003, "weight_decay": 0.0, "amsgrad": True},
]


def problem(seed: int, num_steps: int = 5, dtype: Any = np.float64) -> tuple[list[Arr], list[list[Arr]]]:
    rng = np.random.default_rng(seed)
    shapes = [(3, 4), (4,)]
    params = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(num_steps)]
    return params, grads


@pytest.mark.parametrize("cfg", SGD_CONFIGS)
def test_sgd_matches_reference_recurrence(cfg: dict[str, Any]) -> None:
    init, grads = problem(1)
    params = [nn.Parameter(a.copy()) for a in init]
    run_steps(optim.SGD(params, **cfg), grads)
    args = (cfg["lr"], cfg.get("momentum", 0.0), cfg.get("weight_decay", 0.0))
    for i, p in enumerate(params):
        expected = sgd_reference(
            init[i], [g[i] for g in grads], *args, cfg.get("nesterov", False), cfg.get("dampening", 0.0)
        )
        np.testing.assert_allclose(p.data, expected, rtol=1e-12)


def test_adamw_matches_reference_recurrence() -> None:
    init, grads = problem(2)
    params = [nn.Parameter(a.copy()) for a in init]
    run_steps(optim.AdamW(params, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), grads)
    for i, p in enumerate(params):
        expected = adamw_reference(init[i], [g[i] for g in grads], 0.01, 0.8, 0.99, 1e-6, 0.1)
        np.testing.assert_allclose(p.data, expected, rtol=1e-12)


OPTIM_CASES = [pytest.param("SGD", c, id=f"SGD{i}") for i, c in enumerate(SGD_CONFIGS)] + [
    pytest.param("AdamW", c, id=f"AdamW{i}") for i, c in enumerate(ADAMW_CONFIGS)
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("kind", "cfg"), OPTIM_CASES)
def test_matches_torch_optim(kind: str, cfg: dict[str, Any], dtype: Any) -> None:
    torch = pytest.importorskip("torch")
    init, grads = problem(3, num_steps=6, dtype=dtype)
    params = [nn.Parameter(a.copy()) for a in init]
    run_steps(getattr(optim, kind)(params, **cfg), grads)
    tparams = [torch.tensor(a.copy(), requires_grad=True) for a in init]
    topt = getattr(torch.optim, kind)(tparams, **cfg)
    for step_grads in grads:
        for tp, g in zip(tparams, step_grads):
            tp.grad = torch.tensor(g)
        topt.step()
    rtol = 1e-12 if dtype == np.float64 else 2e-6
    for p, tp in zip(params, tparams):
        assert p.data.dtype == dtype
        np.testing.assert_allclose(p.data, tp.detach().numpy(), rtol=rtol, atol=rtol)


@pytest.mark.parametrize(
    ("kind", "cfg"), [("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}), ("AdamW", {"amsgrad": True})]
)
def test_state_dict_round_trip_continues_identically(kind: str, cfg: dict[str, Any]) -> None:
    init, grads = problem(4, num_steps=6)
    a_params = [nn.Parameter(x.copy()) for x in init]
    a = getattr(optim, kind)(a_params, **cfg)
    run_steps(a, grads[:3])
    saved = a.state_dict()
    snapshot = {
        i: {k: v.copy() if hasattr(v, "copy") else v for k, v in s.items()} for i, s in saved["state"].items()
    }
    b_params = [nn.Parameter(p.data.copy()) for p in a_params]
    b = getattr(optim, kind)(b_params, lr=123.0)  # hyper-parameters come from the state dict
    b.load_state_dict(saved)
    run_steps(a, grads[3:])
    run_steps(b, grads[3:])
    for pa, pb in zip(a_params, b_params):
        assert np.array_equal(pa.data, pb.data)
    # The saved dict holds copies: stepping `a` did not change it, and `b` does not share them.
    for i, s in saved["state"].items():
        for k, v in s.items():
            assert np.array_equal(v, snapshot[i][k]), (i, k)
            if hasattr(v, "shape"):
                assert v is not b.state[i][k]


def test_parameters_of_the_same_name_keep_their_own_checkpoint_state() -> None:
    """Two chunks (as a pipeline's) name their parameters alike; each keeps its state under its own key."""
    chunks = [nn.Sequential(nn.Linear(3, 2, rng=s)) for s in (1, 2)]
    params = [p for c in chunks for p in c.parameters()]
    opt = optim.AdamW(params, lr=0.1)
    for i, p in enumerate(params):
        p.grad = np.full(p.shape, float(i + 1))
    opt.step()
    assert [opt.param_key(i) for i in range(4)] == ["0.weight", "0.bias", "0.weight#1", "0.bias#1"]
    saved = opt.sharded_state_dict()
    state_keys = [k for k in saved if k.startswith("state.")]
    assert len(state_keys) == sum(len(s) for s in opt.state.values()) == 12
    assert np.array_equal(saved["state.0.weight#1.exp_avg"], opt.state[2]["exp_avg"])
    assert not np.array_equal(saved["state.0.weight.exp_avg"], saved["state.0.weight#1.exp_avg"])


def test_load_state_dict_rejects_what_does_not_fit() -> None:
    params = [nn.Parameter(np.zeros((2, 2))), nn.Parameter(np.zeros(3))]
    opt = optim.SGD(params, lr=0.1, momentum=0.9)
    run_steps(opt, [[np.ones((2, 2)), np.ones(3)]])
    good = opt.state_dict()
    other = optim.SGD([nn.Parameter(np.zeros((2, 2))), nn.Parameter(np.zeros(4))], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"state\[1\]\['momentum_buffer'\] has shape \(3,\)"):
        other.load_state_dict(good)
    with pytest.raises(ValueError, match="state index 5"):
        opt.load_state_dict({**good, "state": {5: {}}})
    with pytest.raises(ValueError, match="hyper-parameters"):
        opt.load_state_dict({**good, "hyperparams": {"lr": 0.1}})
    with pytest.raises(ValueError, match="invalid learning rate"):
        opt.load_state_dict({**good, "hyperparams": {**good["hyperparams"], "lr": -1.0}})
    assert opt.lr == 0.1  # a rejected load leaves the optimizer as it was


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: optim.SGD(ps, lr=-0.1), "learning rate"),
        (lambda ps: optim.SGD(ps, lr=0.1, momentum=-1), "momentum"),
        (lambda ps: optim.SGD(ps, lr=0.1, weight_decay=-1), "weight_decay"),
        (lambda ps: optim.SGD(ps, lr=0.1, nesterov=True), "nesterov"),
        (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, dampening=0.1), "nesterov"),
        (lambda ps: optim.AdamW(ps, lr=-1), "learning rate"),
        (lambda ps: optim.AdamW(ps, betas=(0.9, 1.0)), "betas"),
        (lambda ps: optim.AdamW(ps, eps=-1e-8), "eps"),
        (lambda ps: optim.AdamW(ps, weight_decay=-0.1), "weight_decay"),
        (lambda ps: optim.SGD([], lr=0.1), "empty"),
        (lambda ps: optim.SGD([np.zeros(2)], lr=0.1), "expected a Parameter"),
        (lambda ps: optim.SGD(ps + ps, lr=0.1), "twice"),
    ],
)
def test_constructor_validates_hyperparameters(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make([nn.Parameter(np.zeros(2))])


def test_params_without_grad_are_skipped_and_zero_grad_clears() -> None:
    a, b = nn.Parameter(np.ones(2)), nn.Parameter(np.ones(2))
    opt = optim.AdamW([a, b], lr=0.1)
    a.grad = np.ones(2)
    opt.step()
    assert np.array_equal(b.data, np.ones(2)) and 1 not in opt.state
    assert not np.array_equal(a.data, np.ones(2))
    opt.zero_grad(set_to_none=False)
    assert np.array_equal(a.grad, np.zeros(2)) and b.grad is None
    opt.zero_grad()
    assert a.grad is None


def test_step_hooks_run_before_and_after_the_update() -> None:
    p = nn.Parameter(np.ones(2))
    opt = optim.SGD([p], lr=0.5)
    events: list[tuple[str, float]] = []
    pre = opt.register_step_pre_hook(lambda o: events.append(("pre", float(o.params[0].data[0]))))
    opt.register_step_post_hook(lambda o: events.append(("post", float(o.params[0].data[0]))))
    p.grad = np.ones(2)
    opt.step()
    assert events == [("pre", 1.0), ("post", 0.5)]
    pre.remove()
    events.clear()
    opt.step()
    assert events == [("post", 0.0)]


def classification_data(seed: int = 0) -> tuple[Arr, Arr]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    teacher = rng.standard_normal((4, 3))
    return x, np.argmax(x @ teacher, axis=1)


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_tiny_mlp_training_reduces_the_loss(kind: str) -> None:
    x, y = classification_data()
    rng = np.random.default_rng(1)
    model = nn.Sequential(nn.Linear(4, 16, rng=rng), nn.ReLU(), nn.Linear(16, 3, rng=rng))
    opt = (
        optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        if kind == "SGD"
        else optim.AdamW(model.parameters(), lr=0.02)
    )
    crit = nn.CrossEntropyLoss()
    losses = []
    for _ in range(40):
        losses.append(float(crit(model(x), y)))
        opt.zero_grad()
        model.backward(crit.backward())
        opt.step()
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.gpu
def test_optimizers_on_cupy_match_numpy() -> None:
    cp = cupy_module()
    if cp is None:
        pytest.skip("cupy with a CUDA device is not available")
    init, grads = problem(5, dtype=np.float32)
    for kind, cfg in (("SGD", SGD_CONFIGS[2]), ("AdamW", ADAMW_CONFIGS[2])):
        host = [nn.Parameter(a.copy()) for a in init]
        dev = [nn.Parameter(cp.asarray(a)) for a in init]
        run_steps(getattr(optim, kind)(host, **cfg), grads)
        dev_opt = getattr(optim, kind)(dev, **cfg)
        run_steps(dev_opt, [[cp.asarray(g) for g in step] for step in grads])
        for h, d in zip(host, dev):
            np.testing.assert_allclose(h.data, cp.asnumpy(d.data), rtol=1e-5, atol=1e-6)
        restored = getattr(optim, kind)([nn.Parameter(cp.asarray(a)) for a in init], **cfg)
        restored.load_state_dict(dev_opt.state_dict())
        assert all(
            type(v).__module__.startswith("cupy")
            for s in restored.state.values()
            for v in s.values()
            if hasattr(v, "shape")
        )
