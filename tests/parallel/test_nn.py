"""paramplane.nn: gradients against finite differences, hooks, state dicts, init, errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from paramplane import nn
from paramplane.node.arrays import cupy_module

EPS = 1e-6


def numeric_grad(f: Callable[[], float], arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Central differences of the scalar ``f()`` with respect to every element of ``arr`` (perturbed in place)."""
    out = np.zeros_like(arr, dtype=np.float64)
    for i in np.ndindex(arr.shape):
        orig = arr[i]
        arr[i] = orig + EPS
        up = f()
        arr[i] = orig - EPS
        down = f()
        arr[i] = orig
        out[i] = (up - down) / (2 * EPS)
    return out


def check_module_grads(module: nn.Module, x: np.ndarray[Any, Any], num_params: int, seed: int = 0) -> None:
    """backward(g) of ``module`` at ``x`` equals d sum(forward(x) * g) for the input and every parameter."""
    g = np.random.default_rng(seed).standard_normal(module.forward(x).shape)
    module.zero_grad()
    module.forward(x)
    grad_in = module.backward(g)
    analytic = {name: p.grad.copy() for name, p in module.named_parameters()}

    def f() -> float:
        return float((module.forward(x) * g).sum())

    assert grad_in.shape == x.shape
    np.testing.assert_allclose(grad_in, numeric_grad(f, x), rtol=1e-6, atol=1e-8)
    assert len(analytic) == num_params
    for name, p in module.named_parameters():
        np.testing.assert_allclose(
            analytic[name], numeric_grad(f, p.data), rtol=1e-6, atol=1e-8, err_msg=name
        )


def away_from_zero(shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    """float64 values with |x| in [0.2, 2], so ReLU's kink never sits inside a finite-difference step."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.2, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_grads_match_finite_differences_with_leading_batch_dims(bias: bool) -> None:
    layer = nn.Linear(4, 3, bias=bias, dtype=np.float64, rng=1)
    x = np.random.default_rng(2).standard_normal((2, 5, 4))
    check_module_grads(layer, x, num_params=2 if bias else 1)
    assert [n for n, _ in layer.named_parameters()] == (["weight", "bias"] if bias else ["weight"])


@pytest.mark.parametrize("make", [nn.ReLU, nn.GELU], ids=["relu", "gelu"])
def test_activation_grads_match_finite_differences(make: Callable[[], nn.Module]) -> None:
    check_module_grads(make(), away_from_zero((3, 4), seed=3), num_params=0)


def test_gelu_is_the_tanh_approximation_of_the_exact_gelu() -> None:
    x = np.linspace(-6, 6, 241)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    y = nn.GELU().forward(x)
    # The tanh form differs from the erf form by < 1e-3 everywhere, and is not identical to it.
    assert np.max(np.abs(y - exact)) < 1e-3
    assert np.max(np.abs(y - exact)) > 1e-6
    assert np.array_equal(nn.ReLU().forward(x), np.maximum(x, 0))


def test_layernorm_normalises_and_its_grads_match_finite_differences() -> None:
    ln = nn.LayerNorm((2, 3), dtype=np.float64)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 2, 3)) * 3 + 1
    y = ln.forward(x)
    np.testing.assert_allclose(y.mean(axis=(1, 2)), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=(1, 2)), 1, rtol=1e-4)
    assert ln.weight is not None and ln.bias is not None
    ln.weight.data[...] = rng.standard_normal((2, 3))
    ln.bias.data[...] = rng.standard_normal((2, 3))
    check_module_grads(ln, x, num_params=2)


def test_layernorm_without_affine_has_no_parameters_and_correct_input_grad() -> None:
    check_module_grads(
        nn.LayerNorm(5, elementwise_affine=False), np.random.default_rng(6).standard_normal((3, 5)), 0
    )


def test_embedding_picks_rows_and_scatter_adds_repeated_indices() -> None:
    emb = nn.Embedding(5, 3, dtype=np.float64, rng=8)
    idx = np.array([[0, 2, 2], [4, 2, 0]])
    y = emb.forward(idx)
    assert np.array_equal(y, emb.weight.data[idx])
    g = np.random.default_rng(9).standard_normal(y.shape)
    assert emb.backward(g) is None
    expected = np.zeros((5, 3))
    for pos in np.ndindex(idx.shape):
        expected[idx[pos]] += g[pos]
    np.testing.assert_allclose(emb.weight.grad, expected, rtol=1e-12)
    np.testing.assert_allclose(
        emb.weight.grad,
        numeric_grad(lambda: float((emb.forward(idx) * g).sum()), emb.weight.data),
        rtol=1e-6,
        atol=1e-8,
    )
    assert np.all(emb.weight.grad[[1, 3]] == 0)


def test_embedding_rejects_bad_indices() -> None:
    emb = nn.Embedding(4, 2)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        emb.forward(np.array([0, 4]))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        emb.forward(np.array([-1]))
    with pytest.raises(ValueError, match="integer"):
        emb.forward(np.array([0.0, 1.0]))


def test_dropout_train_mode_is_seeded_scaled_and_its_grad_matches_finite_differences() -> None:
    p, seed = 0.4, 11
    x = np.random.default_rng(12).standard_normal((6, 7))
    g = np.random.default_rng(13).standard_normal((6, 7))
    drop = nn.Dropout(p, seed=seed)
    y = drop.forward(x)
    grad_in = drop.backward(g)
    kept = y != 0
    assert 0 < kept.sum() < x.size
    np.testing.assert_allclose(y[kept], x[kept] / (1 - p), rtol=1e-12)
    # Same seed -> same first mask, so a fresh layer per evaluation gives a fixed function.
    assert np.array_equal(nn.Dropout(p, seed=seed).forward(x), y)
    numeric = numeric_grad(lambda: float((nn.Dropout(p, seed=seed).forward(x) * g).sum()), x)
    np.testing.assert_allclose(grad_in, numeric, rtol=1e-6, atol=1e-8)
    # Successive calls draw new masks.
    assert not np.array_equal(drop.forward(x) != 0, kept)


def test_dropout_is_identity_in_eval_and_validates_p() -> None:
    drop = nn.Dropout(0.9, seed=0).eval()
    x = np.arange(6.0)
    assert np.array_equal(drop.forward(x), x)
    assert np.array_equal(drop.backward(x), x)
    assert np.all(nn.Dropout(1.0, seed=0).forward(x) == 0)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="probability"):
            nn.Dropout(bad)


def small_mlp(seed: int = 0, dtype: Any = np.float64) -> nn.Sequential:
    rng = np.random.default_rng(seed)
    return nn.Sequential(
        nn.Linear(4, 6, dtype=dtype, rng=rng),
        nn.GELU(),
        nn.LayerNorm(6, dtype=dtype),
        nn.Linear(6, 5, dtype=dtype, rng=rng),
        nn.ReLU(),
        nn.Linear(5, 3, dtype=dtype, rng=rng),
    )


def test_sequential_grads_match_finite_differences() -> None:
    model = small_mlp()
    check_module_grads(model, np.random.default_rng(14).standard_normal((3, 4)), num_params=8)
    assert len(model) == 6
    assert isinstance(model[2], nn.LayerNorm)
    assert len(model[1:3]) == 2


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["mse", "ce"])
def test_loss_grads_match_finite_differences(kind: str, reduction: str) -> None:
    rng = np.random.default_rng(15)
    pred = rng.standard_normal((4, 3))
    crit: nn.Loss
    if kind == "mse":
        crit, target = nn.MSELoss(reduction), rng.standard_normal((4, 3))
    else:
        crit, target = nn.CrossEntropyLoss(reduction), np.array([0, 2, 1, 2])
    loss = crit.forward(pred, target)
    assert loss.shape == ()
    grad = crit.backward()
    scaled = (crit.forward(pred, target), crit.backward(grad_scale=0.25))[1]
    assert grad.shape == pred.shape
    np.testing.assert_allclose(grad, numeric_grad(lambda: float(crit.forward(pred, target)), pred), rtol=1e-6)
    np.testing.assert_allclose(scaled, 0.25 * grad, rtol=1e-12)


def test_loss_reductions_relate_by_the_local_count() -> None:
    rng = np.random.default_rng(16)
    pred, target = rng.standard_normal((5, 3)), rng.integers(0, 3, size=5)
    ce_sum, ce_mean = nn.CrossEntropyLoss("sum"), nn.CrossEntropyLoss("mean")
    np.testing.assert_allclose(float(ce_sum(pred, target)), 5 * float(ce_mean(pred, target)), rtol=1e-12)
    np.testing.assert_allclose(ce_sum.backward(), 5 * ce_mean.backward(), rtol=1e-12)
    mse_sum, mse_mean = nn.MSELoss("sum"), nn.MSELoss("mean")
    t = rng.standard_normal((5, 3))
    np.testing.assert_allclose(float(mse_sum(pred, t)), float(((pred - t) ** 2).sum()), rtol=1e-12)
    np.testing.assert_allclose(float(mse_mean(pred, t)), float(((pred - t) ** 2).mean()), rtol=1e-12)


def test_cross_entropy_is_stable_for_huge_logits_and_accepts_leading_dims() -> None:
    logits = np.array([[1000.0, 0.0, -1000.0], [5000.0, 5000.0, 0.0]], dtype=np.float32)
    crit = nn.CrossEntropyLoss("sum")
    loss = float(crit(logits, np.array([0, 1])))
    assert math.isfinite(loss)
    np.testing.assert_allclose(loss, math.log(2), rtol=1e-6)  # row 0 contributes ~0, row 1 log 2
    grad = crit.backward()
    assert grad.dtype == np.float32 and np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad[1], [0.5, -0.5, 0.0], atol=1e-7)
    x = np.random.default_rng(17).standard_normal((2, 3, 4))
    t = np.random.default_rng(18).integers(0, 4, size=(2, 3))
    flat = nn.CrossEntropyLoss()
    np.testing.assert_allclose(float(nn.CrossEntropyLoss()(x, t)), float(flat(x.reshape(6, 4), t.reshape(6))))


def test_losses_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="reduction"):
        nn.MSELoss("avg")
    with pytest.raises(ValueError, match="same shape"):
        nn.MSELoss()(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        nn.CrossEntropyLoss()(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="integer"):
        nn.CrossEntropyLoss()(np.zeros((2, 3)), np.array([0.0, 1.0]))
    with pytest.raises(RuntimeError, match="without a forward"):
        nn.MSELoss().backward()


def test_torch_agrees_on_layers_and_losses() -> None:
    torch = pytest.importorskip("torch")
    model = small_mlp(seed=3)
    x = np.random.default_rng(19).standard_normal((4, 4))
    target = np.array([0, 1, 2, 1])
    crit = nn.CrossEntropyLoss()
    loss = crit(model(x), target)
    model.backward(crit.backward())

    lin = [model[0], model[3], model[5]]
    tx = torch.tensor(x, requires_grad=True)
    params = [torch.tensor(p.data, requires_grad=True) for m in lin for p in m.parameters()]
    h = torch.nn.functional.linear(tx, params[0], params[1])
    h = torch.nn.functional.gelu(h, approximate="tanh")
    h = torch.nn.functional.layer_norm(h, (6,), eps=1e-5)
    h = torch.relu(torch.nn.functional.linear(h, params[2], params[3]))
    out = torch.nn.functional.linear(h, params[4], params[5])
    tloss = torch.nn.functional.cross_entropy(out, torch.tensor(target))
    tloss.backward()
    np.testing.assert_allclose(float(loss), tloss.item(), rtol=1e-12)
    ours = [p.grad for m in lin for p in m.parameters()]
    for mine, theirs in zip(ours, params):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_grad_hooks_fire_once_per_backward_after_the_grad_is_complete_in_reverse_order() -> None:
    model = small_mlp()
    x = np.random.default_rng(20).standard_normal((3, 4))
    fired: list[str] = []
    seen: dict[str, np.ndarray[Any, Any]] = {}

    def hook(p: nn.Parameter) -> None:
        fired.append(p.name)
        seen[p.name] = p.grad.copy()

    handles = [p.register_grad_hook(hook) for p in model.parameters()]
    model.backward(model.forward(x))
    names = [n for n, _ in model.named_parameters()]
    assert fired == names[::-1]
    for name, p in model.named_parameters():
        assert np.array_equal(seen[name], p.grad), f"{name} changed after its hook fired"

    # A second backward accumulates and fires every hook once more.
    first = {n: p.grad.copy() for n, p in model.named_parameters()}
    fired.clear()
    model.backward(model.forward(x))
    assert fired == names[::-1]
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, 2 * first[name], rtol=1e-12)

    for h in handles:
        h.remove()
    fired.clear()
    model.backward(model.forward(x))
    assert fired == []


def test_accumulate_grad_writes_through_a_preset_view_and_checks_shape() -> None:
    layer = nn.Linear(3, 2, dtype=np.float64, rng=0)
    flat = np.zeros(layer.weight.size + 2)
    assert layer.bias is not None
    layer.weight.grad = flat[:6].reshape(2, 3)
    layer.bias.grad = flat[6:]
    x = np.ones((4, 3))
    layer.forward(x)
    layer.backward(np.ones((4, 2)))
    np.testing.assert_allclose(flat[:6], 4.0)
    np.testing.assert_allclose(flat[6:], 4.0)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        layer.bias.accumulate_grad(np.zeros(3))


def test_names_are_dotted_paths_and_order_is_registration_depth_first() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(np.ones(1))
            self.body = small_mlp()
            self.head = nn.Linear(3, 2, rng=0)
            self.register_buffer("steps", np.zeros(1, dtype=np.int64))

    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names[:3] == ["scale", "body.0.weight", "body.0.bias"]
    assert names[-2:] == ["head.weight", "head.bias"]
    assert [p.name for p in net.parameters()] == names
    assert [n for n, _ in net.named_buffers()] == ["steps"]
    assert set(net.state_dict()) == {*names, "steps"}
    net.eval()
    assert not any(m.training for _, m in net.named_modules())
    net.train()
    assert all(m.training for _, m in net.named_modules())


def test_state_dict_round_trip_copies_and_load_errors() -> None:
    src, dst = small_mlp(seed=1), small_mlp(seed=2)
    state = src.state_dict()
    state["0.weight"][...] = 7.0  # a copy: the module is untouched
    assert not np.any(src[0].parameters()[0].data == 7.0)
    state = src.state_dict()
    view = dst[0].parameters()[0].data
    assert dst.load_state_dict(state) == ([], [])
    for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert np.array_equal(a.data, b.data), name
    assert view is dst[0].parameters()[0].data  # loaded in place

    missing = {k: v for k, v in state.items() if k != "3.bias"}
    with pytest.raises(ValueError, match=r"missing keys \['3.bias'\]"):
        dst.load_state_dict(missing)
    with pytest.raises(ValueError, match=r"unexpected keys.*extra"):
        dst.load_state_dict({**state, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"'0.weight' has shape \(4, 6\)"):
        dst.load_state_dict({**state, "0.weight": np.zeros((4, 6))})
    with pytest.raises(ValueError, match=r"'0\.bias' has dtype float32"):
        dst.load_state_dict({**state, "0.bias": state["0.bias"].astype(np.float32)})
    result = dst.load_state_dict({**missing, "extra": np.zeros(1)}, strict=False)
    assert result.missing_keys == ["3.bias"] and result.unexpected_keys == ["extra"]


def test_tied_weights_load_their_own_state_dict() -> None:
    """A parameter shared by two layers is saved once (its first name) and loads through that name."""

    class Tied(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4, rng=seed)
            self.head = nn.Linear(4, 10, bias=False, rng=seed)
            self.head.weight = self.emb.weight

    src, dst = Tied(1), Tied(2)
    state = src.state_dict()
    assert set(state) == {"emb.weight"}
    assert dst.load_state_dict(state) == ([], [])
    assert np.array_equal(dst.head.weight.data, src.emb.weight.data)
    assert dst.head.weight is dst.emb.weight
    with pytest.raises(ValueError, match=r"missing keys \['emb.weight', 'head.weight'\]"):
        dst.load_state_dict({})


def test_init_is_deterministic_given_a_seed_and_like_torch() -> None:
    a, b, c = nn.Linear(16, 64, rng=5), nn.Linear(16, 64, rng=5), nn.Linear(16, 64, rng=6)
    assert np.array_equal(a.weight.data, b.weight.data)
    assert not np.array_equal(a.weight.data, c.weight.data)
    assert a.weight.shape == (64, 16) and a.weight.dtype == np.float32
    w = a.weight.data
    assert np.all(np.abs(w) <= 0.25) and np.abs(w).max() > 0.24 and abs(float(w.mean())) < 0.03
    assert np.array_equal(
        small_mlp(seed=3).state_dict()["5.weight"], small_mlp(seed=3).state_dict()["5.weight"]
    )
    shared = np.random.default_rng(0)
    first, second = nn.Linear(4, 4, rng=shared), nn.Linear(4, 4, rng=shared)
    assert not np.array_equal(first.weight.data, second.weight.data)
    with pytest.raises(ValueError, match="rng"):
        nn.Linear(2, 2, rng="seed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="in_features"):
        nn.Linear(0, 2)


def test_backward_needs_a_forward_and_inputs_are_checked() -> None:
    layer = nn.Linear(3, 2, rng=0)
    with pytest.raises(RuntimeError, match="without a forward"):
        layer.backward(np.zeros((1, 2)))
    layer.forward(np.zeros((1, 3), dtype=np.float32))
    layer.backward(np.zeros((1, 2), dtype=np.float32))
    with pytest.raises(RuntimeError, match="without a forward"):
        layer.backward(np.zeros((1, 2)))
    with pytest.raises(ValueError, match=r"\(\.\.\., 3\)"):
        layer.forward(np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"LayerNorm expects"):
        nn.LayerNorm(4).forward(np.zeros((2, 3)))


def test_forward_state_can_be_parked_for_interleaved_microbatches() -> None:
    model, ref = small_mlp(seed=4), small_mlp(seed=4)
    rng = np.random.default_rng(21)
    xs, gs = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 3))
    parked = []
    for x in xs:
        model.forward(x)
        parked.append(model.take_forward_state())
    for i in (1, 0):  # backward in the other order
        model.restore_forward_state(parked[i])
        model.backward(gs[i])
    for x, g in zip(xs, gs):
        ref.forward(x)
        ref.backward(g)
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(a.grad, b.grad, rtol=1e-12, err_msg=name)
    with pytest.raises(ValueError, match="does not have"):
        model.restore_forward_state({"9": {}})


@pytest.mark.gpu
def test_cupy_matches_numpy() -> None:
    cp = cupy_module()
    if cp is None:
        pytest.skip("cupy with a CUDA device is not available")
    host = small_mlp(seed=7, dtype=np.float32)
    dev = small_mlp(seed=7, dtype=np.float32).to("cuda")
    x = np.random.default_rng(22).standard_normal((5, 4)).astype(np.float32)
    t = np.array([0, 1, 2, 0, 1])
    results = []
    for model, xp in ((host, np), (dev, cp)):
        crit = nn.CrossEntropyLoss()
        loss = crit(model(xp.asarray(x)), xp.asarray(t))
        grad_in = model.backward(crit.backward())
        results.append((float(loss), cp.asnumpy(grad_in) if xp is cp else grad_in, model))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-4, atol=1e-6)
    for (name, a), (_, b) in zip(host.named_parameters(), dev.named_parameters()):
        assert type(b.grad).__module__.startswith("cupy")
        np.testing.assert_allclose(a.grad, cp.asnumpy(b.grad), rtol=1e-4, atol=1e-6, err_msg=name)
    emb = nn.Embedding(4, 3, rng=0, xp=cp)
    emb.forward(cp.asarray([1, 1, 3]))
    emb.backward(cp.ones((3, 3), dtype=cp.float32))
    np.testing.assert_allclose(cp.asnumpy(emb.weight.grad)[:, 0], [0, 2, 0, 1])
    x_dev = cp.ones((4, 5), dtype=cp.float32)
    assert np.array_equal(
        cp.asnumpy(nn.Dropout(0.5, seed=1)(x_dev)), nn.Dropout(0.5, seed=1)(cp.asnumpy(x_dev))
    )
    assert type(dev.to("cpu").parameters()[0].data) is np.ndarray


@pytest.mark.parametrize("causal", [True, False])
def test_attention_grads_match_finite_differences(causal: bool) -> None:
    attn = nn.MultiHeadAttention(4, 2, causal=causal, dtype=np.float64, rng=5)
    check_module_grads(attn, np.random.default_rng(6).standard_normal((2, 3, 4)), num_params=8)


def test_attention_equals_torch_scaled_dot_product_attention_and_checks_heads() -> None:
    attn = nn.MultiHeadAttention(6, 3, dtype=np.float64, rng=8)
    x = np.random.default_rng(9).standard_normal((2, 5, 6))
    y = attn(x)
    future = x.copy()
    future[:, -1] += 1.0  # causal: the last position changes nothing before it
    np.testing.assert_array_equal(attn(future)[:, :-1], y[:, :-1])
    with pytest.raises(ValueError, match="divisible by num_heads=4"):
        nn.MultiHeadAttention(6, 4)
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(m(x)).reshape(2, 5, 3, 2).transpose(1, 2) for m in (attn.q, attn.k, attn.v))
    ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = attn.o(ctx.transpose(1, 2).reshape(2, 5, 6).numpy())
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-14)
