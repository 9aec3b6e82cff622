"""One validation per call (issue #18): ``prepare`` runs once per public call, and the remembered
problem of a repeated call shape never skips a check that the new arrays need."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

import fastattn
import fastattn.torch as fastattn_torch
from fastattn import _validation
from fastattn._options import AttentionOptions
from fastattn.backends import cpu, registry
from fastattn.nn import KVCache, MultiheadAttention


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the calls of ``prepare`` and ``prepare_gradient`` by direction."""
    counts: Counter[str] = Counter()
    prepare, prepare_gradient = _validation.prepare, _validation.prepare_gradient

    def counting_prepare(direction, *args, **kwargs):
        counts[direction] += 1
        return prepare(direction, *args, **kwargs)

    def counting_gradient(*args, **kwargs):
        counts["gradient"] += 1
        return prepare_gradient(*args, **kwargs)

    monkeypatch.setattr(_validation, "prepare", counting_prepare)
    monkeypatch.setattr(_validation, "prepare_gradient", counting_gradient)
    return counts


def _inputs(rng: np.random.Generator, seq_q: int = 5, seq_k: int = 9) -> tuple[np.ndarray, ...]:
    q = rng.standard_normal((2, 4, seq_q, 8))
    k, v = rng.standard_normal((2, 2, seq_k, 8)), rng.standard_normal((2, 2, seq_k, 8))
    return q, k, v, rng.standard_normal((2, 4, seq_q, 8))


def test_each_numpy_call_validates_once(counted: Counter[str]) -> None:
    q, k, v, dout = _inputs(np.random.default_rng())
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    assert counted == {"forward": 1}
    fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert counted == {"forward": 1, "backward": 1}
    counted.clear()
    fastattn.explain(q, k, v)
    fastattn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert counted == {"forward": 2}


@pytest.mark.parametrize("entry", ["attention", "scaled_dot_product_attention"])
def test_the_torch_backward_checks_only_dout(counted: Counter[str], entry: str) -> None:
    q, k, v, dout = (torch.from_numpy(x).requires_grad_() for x in _inputs(np.random.default_rng()))
    if entry == "attention":
        out = fastattn_torch.attention(q, k, v, causal=True)
    else:
        out = fastattn_torch.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.autograd.grad(out, (q, k, v), dout.detach())
    assert counted == {"forward": 1, "gradient": 1}


def test_the_layer_validates_once_per_call(counted: Counter[str]) -> None:
    rng = np.random.default_rng()
    layer = MultiheadAttention(16, 4, 2, causal=True, dtype=np.float64, seed=1)
    x = rng.standard_normal((2, 5, 16))
    out = layer(x)
    layer.backward(np.ones_like(out))
    assert counted == {"forward": 1, "gradient": 1}
    counted.clear()
    layer.eval()
    cache = KVCache(2, 8, 2, 4, dtype=np.float64)
    layer(x, cache=cache)
    layer(x[:, :1], cache=cache)
    assert counted == {"forward": 2}


def test_a_repeated_shape_reads_the_new_arrays() -> None:
    rng = np.random.default_rng()
    for _ in range(3):
        q, k, v, _ = _inputs(rng)
        lengths = rng.integers(0, 10, size=2)
        out = fastattn.attention(q, k, v, key_lengths=lengths, causal="bottom_right", backend="cpu")
        expected = fastattn.attention(q, k, v, key_lengths=lengths, causal="bottom_right", backend="reference")
        np.testing.assert_allclose(out, expected, atol=1e-10)


def test_a_repeated_shape_still_checks_what_the_arrays_need() -> None:
    q, k, v, _ = _inputs(np.random.default_rng())
    fastattn.attention(q, k, v, key_lengths=np.array([3, 9]), backend="cpu")
    with pytest.raises(ValueError, match=r"key_lengths: expected values in \[0, Sk=9\], received values in \[3, 10\]"):
        fastattn.attention(q, k, v, key_lengths=np.array([3, 10]), backend="cpu")
    with pytest.raises(TypeError, match="k: expected dtype float64"):
        fastattn.attention(q, k.astype(np.float32), v, backend="cpu")
    strided = np.zeros(q.shape[:3] + (16,))[..., ::2]
    strided[...] = q
    np.testing.assert_array_equal(fastattn.attention(strided, k, v), fastattn.attention(q, k, v))


@pytest.mark.parametrize(
    ("option", "good", "bad", "error"),
    [
        ("causal", True, 1, ValueError),
        ("scale", 1.0, True, TypeError),
        ("softcap", 1.0, True, TypeError),
        ("dropout_p", 0.0, False, TypeError),
        ("window", (1, 1), (1, True), TypeError),
        ("return_lse", False, 0, TypeError),
    ],
)
def test_equal_values_of_another_type_are_not_taken_for_a_remembered_option(
    option: str, good: object, bad: object, error: type[Exception]
) -> None:
    q, k, v, _ = _inputs(np.random.default_rng())
    fastattn.attention(q, k, v, **{option: good})
    with pytest.raises(error, match=option):
        fastattn.attention(q, k, v, **{option: bad})


def test_a_numpy_float_scale_is_remembered_as_its_float_and_a_float32_one_still_runs() -> None:
    q, k, v, _ = _inputs(np.random.default_rng())
    expected = fastattn.attention(q, k, v, scale=0.25, backend="reference")
    fastattn.attention(q, k, v, scale=0.25)
    remembered = len(_validation._validated)
    np.testing.assert_allclose(fastattn.attention(q, k, v, scale=np.float64(0.25)), expected, atol=1e-12)
    assert len(_validation._validated) == remembered
    np.testing.assert_allclose(fastattn.attention(q, k, v, scale=np.float32(0.25)), expected, atol=1e-12)
    with pytest.raises(ValueError, match="scale: expected a finite number"):
        fastattn.attention(q, k, v, scale=np.float64("nan"))


@pytest.mark.parametrize("name", ["q", "k", "mask", "lse"])
def test_arrays_of_the_other_byte_order_are_refused(name: str) -> None:
    q, k, v, dout = _inputs(np.random.default_rng())
    mask = np.ones((1, 1, q.shape[2], k.shape[2]))
    out, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True)
    swapped = {"q": q, "k": k, "mask": mask, "lse": lse}[name]
    swapped = swapped.astype(swapped.dtype.newbyteorder())
    arrays = {"q": q, "k": k, "mask": mask, "lse": lse, name: swapped}
    with pytest.raises(TypeError, match=f"{name}: expected the machine's byte order, received dtype >f8"):
        fastattn.attention_backward(dout, arrays["q"], arrays["k"], v, out, arrays["lse"], mask=arrays["mask"])


def test_arrays_of_several_frameworks_and_subclasses_are_told_apart() -> None:
    """The same shapes from other frameworks, in other positions, or as an ndarray subclass, are
    other call descriptions: each result comes back in q's framework, with the same values."""

    class Subclass(np.ndarray):
        pass

    q, k, v, _ = _inputs(np.random.default_rng())
    expected = fastattn.attention(q, k, v, backend="reference")
    t = {name: torch.from_numpy(x) for name, x in (("q", q), ("k", k), ("v", v))}
    for _ in range(2):
        assert isinstance(fastattn.attention(q, t["k"], t["v"]), np.ndarray)
        mixed = fastattn.attention(t["q"], k, v)
        assert isinstance(mixed, torch.Tensor)
        np.testing.assert_allclose(mixed.numpy(), expected, atol=1e-12)
        np.testing.assert_allclose(fastattn.attention(q.view(Subclass), k, v), expected, atol=1e-12)


def test_the_registry_forgets_its_choices_when_backends_change() -> None:
    q, k, v, _ = _inputs(np.random.default_rng())
    fastattn.attention(q, k, v)
    explanation = fastattn.explain(q, k, v)
    assert explanation.chosen == "cpu"
    cpu = fastattn.backends.registry.get("cpu")
    fastattn.backends.registry.unregister("cpu")
    try:
        assert fastattn.explain(q, k, v).chosen == "reference"
    finally:
        fastattn.backends.register(cpu)
    assert fastattn.explain(q, k, v).chosen == "cpu"


def test_plans_and_selections_are_kept_per_problem_object() -> None:
    """Kept by identity: the same problem meets its plan and backend again; an equal problem of
    another identity gets its own, which computes the same result."""
    q, k, v, _ = _inputs(np.random.default_rng())
    call = _validation.prepare("forward", {"q": q, "k": k, "v": v}, AttentionOptions())
    twin = dataclasses.replace(call.problem)
    assert twin == call.problem and twin is not call.problem
    assert cpu.forward_plan(call.problem, 2) is cpu.forward_plan(call.problem, 2)
    assert registry.select(twin) is registry.select(call.problem)
    out, lse = cpu.forward_plan(call.problem, 2).run(q, k, v, call.extras)
    twin_out, twin_lse = cpu.forward_plan(twin, 2).run(q, k, v, call.extras)
    np.testing.assert_array_equal(out, twin_out)
    np.testing.assert_array_equal(lse, twin_lse)
