"""``fastattn.torch``: float64 gradcheck, parity with PyTorch's SDPA, training, errors.

gradcheck runs on the automatic choice for CPU tensors (the ``cpu`` backend) and on ``reference``
(through ``fastattn.use_backend``), over every contract option that changes the gradient.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import fastattn

torch = pytest.importorskip("torch")
fastattn_torch = pytest.importorskip("fastattn.torch")

B, HQ, HKV, SQ, SK, D = 1, 4, 2, 5, 7, 8


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTATTN_BACKEND", raising=False)


def _bool_mask() -> Any:
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(B, HQ, SQ, SK, generator=generator) < 0.7
    mask[0, 1, 2] = False  # a row that sees no key: zero output, zero gradient
    return mask


def _float_mask() -> Any:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(1, 1, SQ, SK, generator=generator, dtype=torch.float64)


GRADCHECK_CASES: dict[str, dict[str, Any]] = {
    "plain": {"heads_kv": HQ},
    "gqa": {},
    "scale": {"scale": 0.3},
    "causal_top_left": {"causal": True},
    "causal_bottom_right": {"causal": "bottom_right"},
    "bool_mask": {"mask": _bool_mask()},
    "float_mask": {"mask": _float_mask()},
    "key_lengths": {"key_lengths": torch.tensor([4])},
    "window": {"window": (2, 1)},
    "window_bottom_right": {"window": (3, 0), "causal": "bottom_right"},
    "softcap": {"softcap": 2.0},
    "bshd_dv": {"layout": "bshd", "head_dim_v": 6},
}


def _inputs(
    heads_kv: int = HKV,
    head_dim_v: int = D,
    layout: str = "bhsd",
    dtype: Any = torch.float64,
    seed: int = 0,
) -> tuple[Any, Any, Any]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(B, HQ, SQ, D), (B, heads_kv, SK, D), (B, heads_kv, SK, head_dim_v)]
    tensors = []
    for shape in shapes:
        if layout == "bshd":
            shape = (shape[0], shape[2], shape[1], shape[3])
        tensors.append(torch.randn(shape, generator=generator, dtype=dtype).requires_grad_())
    return tensors[0], tensors[1], tensors[2]


def _split(case: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    shape_keys = {"heads_kv", "head_dim_v"}
    shapes = {key: value for key, value in case.items() if key in shape_keys}
    options = {key: value for key, value in case.items() if key not in shape_keys}
    if "layout" in options:
        shapes["layout"] = options["layout"]
    return shapes, options


@pytest.mark.parametrize("backend", [None, "reference"], ids=["automatic", "reference"])
@pytest.mark.parametrize("name", list(GRADCHECK_CASES))
def test_gradcheck_float64(name: str, backend: str | None) -> None:
    shapes, options = _split(GRADCHECK_CASES[name])
    q, k, v = _inputs(**shapes)
    with fastattn.use_backend(backend):
        chosen = fastattn.explain(q.detach(), k.detach(), v.detach(), **options)
        assert (chosen.chosen, chosen.chosen_backward) == ((backend,) * 2 if backend else ("cpu", "cpu"))
        assert torch.autograd.gradcheck(
            lambda q, k, v: fastattn_torch.attention(q, k, v, **options), (q, k, v), eps=1e-6, atol=1e-6
        )


def test_sdpa_gradcheck_float64() -> None:
    q, k, v = _inputs()
    mask = _float_mask()[0]
    assert torch.autograd.gradcheck(
        lambda q, k, v: fastattn_torch.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        (q, k, v),
        eps=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True, "enable_gqa": True},
        {"attn_mask": "float", "enable_gqa": True},
        {"attn_mask": "bool"},
        {"scale": 0.2, "unbatched": True},
    ],
    ids=["causal_gqa", "float_mask", "bool_mask", "three_d"],
)
def test_sdpa_matches_torch(options: dict[str, Any]) -> None:
    """Forward and gradients against torch's SDPA in float32; ``.sum()`` hands back an expanded grad."""
    options = dict(options)
    unbatched = options.pop("unbatched", False)
    q, k, v = _inputs(heads_kv=HKV if options.get("enable_gqa") else HQ, dtype=torch.float32, seed=4)
    if options.get("attn_mask") == "float":
        options["attn_mask"] = _float_mask().float()
    elif options.get("attn_mask") == "bool":
        options["attn_mask"] = torch.ones(SQ, SK, dtype=torch.bool).tril(diagonal=2)
    if unbatched:
        q, k, v = (x.detach()[:, 0].requires_grad_() for x in (q, k, v))
    ours = fastattn_torch.scaled_dot_product_attention(q, k, v, **options)
    ours.sum().backward()
    ours_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
    theirs.sum().backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for mine, expected in zip(ours_grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-5)


def test_return_lse_is_detached_and_matches_the_forward() -> None:
    q, k, v = _inputs()
    out, lse = fastattn_torch.attention(q, k, v, causal=True, return_lse=True)
    expected_out, expected_lse = fastattn.attention(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    torch.testing.assert_close(out.detach(), expected_out)
    torch.testing.assert_close(lse, expected_lse)


def test_only_inputs_that_require_grad_get_one() -> None:
    q, k, v = _inputs()
    k.requires_grad_(False)
    fastattn_torch.attention(q, k, v).sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None


def test_numpy_mask_and_key_lengths_with_tensors() -> None:
    q, k, v = _inputs()
    mask = _bool_mask().numpy()
    lengths = np.array([6])
    fastattn_torch.attention(q, k, v, mask=mask, key_lengths=lengths).sum().backward()
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fastattn_torch.attention(q2, k2, v2, mask=torch.from_numpy(mask), key_lengths=torch.from_numpy(lengths))
    out.sum().backward()
    for first, second in zip((q, k, v), (q2, k2, v2)):
        torch.testing.assert_close(first.grad, second.grad)


def test_backward_runs_on_the_backend_chosen_at_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = fastattn.backends.get("reference")
    calls = []
    original = reference.backward

    def counting_backward(*args: Any) -> Any:
        calls.append(True)
        return original(*args)

    monkeypatch.setattr(reference, "backward", counting_backward)
    q, k, v = _inputs()
    with fastattn.use_backend("reference"):
        out = fastattn_torch.attention(q, k, v, causal=True)
    out.sum().backward()  # outside the with block
    assert calls == [True]


def test_bfloat16_forward_and_backward() -> None:
    q, k, v = _inputs(dtype=torch.float32, seed=5)
    low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    reference = [x.detach().bfloat16().float().requires_grad_() for x in (q, k, v)]
    out_low = fastattn_torch.attention(*low, causal=True)
    out_ref = fastattn_torch.attention(*reference, causal=True)
    assert out_low.dtype == torch.bfloat16
    gradient = torch.randn(out_low.shape, generator=torch.Generator().manual_seed(6))
    out_low.backward(gradient.bfloat16())
    out_ref.backward(gradient)
    torch.testing.assert_close(out_low.float(), out_ref.detach(), rtol=2e-2, atol=2e-2)
    for mine, expected in zip(low, reference):
        assert mine.grad.dtype == torch.bfloat16
        torch.testing.assert_close(mine.grad.float(), expected.grad, rtol=5e-2, atol=5e-2)


def test_no_double_backward() -> None:
    q, k, v = _inputs()
    out = fastattn_torch.attention(q, k, v)
    (grad_q,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)  # dout depends on q
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_q.sum().backward()


def test_mask_that_requires_grad_is_refused() -> None:
    q, k, v = _inputs()
    mask = _float_mask().requires_grad_()
    with pytest.raises(fastattn.UnsupportedError, match="^mask: expected a mask that does not require grad"):
        fastattn_torch.attention(q, k, v, mask=mask)
    with pytest.raises(fastattn.UnsupportedError, match="^attn_mask: "):
        fastattn_torch.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_dropout_gradcheck_with_a_fixed_seed(backend: str | None) -> None:
    q, k, v = (t.requires_grad_() for t in _inputs())
    options = {"causal": True, "dropout_p": 0.3, "dropout_seed": 1234, "dropout_offset": 5, "backend": backend}
    assert torch.autograd.gradcheck(lambda *x: fastattn_torch.attention(*x, **options), (q, k, v))


def test_dropout_without_seed_follows_torch_manual_seed() -> None:
    q, k, v = _inputs(heads_kv=HQ)
    torch.manual_seed(7)
    first = fastattn_torch.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    second = fastattn_torch.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    again = fastattn_torch.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(first, again) and not torch.equal(first, second)


@pytest.mark.parametrize(
    ("options", "error", "argument"),
    [
        ({"return_lse": 1}, TypeError, "return_lse"),
        ({"backend": "nope"}, ValueError, "backend"),
        ({"causal": "sideways"}, ValueError, "causal"),
        ({"layout": "hbsd"}, ValueError, "layout"),
    ],
)
def test_bad_arguments_name_themselves(options: dict[str, Any], error: type[Exception], argument: str) -> None:
    q, k, v = _inputs()
    with pytest.raises(error, match=f"^{argument}: expected"):
        fastattn_torch.attention(q, k, v, **options)


def test_sdpa_errors_name_pytorch_arguments() -> None:
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="^key: expected 4 heads"):
        fastattn_torch.scaled_dot_product_attention(q, k, v)
    with pytest.raises(TypeError, match="^value: expected dtype float64"):
        fastattn_torch.scaled_dot_product_attention(q, k, v.detach().float(), enable_gqa=True)


class _TinyModel(torch.nn.Module):
    """Embedding + positions -> q/k/v projections -> causal GQA attention -> vocabulary logits."""

    def __init__(self, vocab: int, seq: int, heads: int, heads_kv: int, head_dim: int, use_fastattn: bool) -> None:
        super().__init__()
        dim = heads * head_dim
        self.heads, self.heads_kv, self.head_dim, self.use_fastattn = heads, heads_kv, head_dim, use_fastattn
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Parameter(0.5 * torch.randn(seq, dim))
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, heads_kv * head_dim)
        self.v = torch.nn.Linear(dim, heads_kv * head_dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: Any) -> Any:
        batch, seq = tokens.shape
        x = self.embed(tokens) + self.position
        q = self.q(x).view(batch, seq, self.heads, self.head_dim)  # (B, S, H, D): fastattn's "bshd"
        k = self.k(x).view(batch, seq, self.heads_kv, self.head_dim)
        v = self.v(x).view(batch, seq, self.heads_kv, self.head_dim)
        if self.use_fastattn:
            y = fastattn_torch.attention(q, k, v, causal=True, layout="bshd")
        else:
            y = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
            ).transpose(1, 2)
        return self.out(y.reshape(batch, seq, -1))


def _train(use_fastattn: bool, steps: int = 20) -> list[float]:
    vocab, seq = 12, 10
    torch.manual_seed(0)
    model = _TinyModel(vocab, seq, heads=4, heads_kv=2, head_dim=8, use_fastattn=use_fastattn)
    tokens = torch.randint(0, vocab, (16, seq), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)  # each position predicts the previous token
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_training_a_small_module() -> None:
    """The loss falls clearly, and follows the same module trained with PyTorch's own attention."""
    ours = _train(use_fastattn=True)
    theirs = _train(use_fastattn=False)
    assert ours[-1] < 0.1 * ours[0], ours
    np.testing.assert_allclose(ours, theirs, rtol=1e-3)


def test_import_fastattn_does_not_import_torch_and_the_adapter_gets_the_real_torch() -> None:
    code = (
        "import sys, fastattn\n"
        "assert 'torch' not in sys.modules, 'import fastattn imported torch'\n"
        "import fastattn.torch\n"
        "import torch\n"
        "assert fastattn.torch.torch is sys.modules['torch'] is torch\n"
        "assert hasattr(torch, 'autograd') and 'fastattn' not in torch.__file__\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_gradcheck() -> None:
    pytest.importorskip("cupy")
    q, k, v = (x.detach().cuda().requires_grad_() for x in _inputs())
    out = fastattn_torch.attention(q, k, v, causal="bottom_right")
    assert out.device == q.device
    assert torch.autograd.gradcheck(
        lambda q, k, v: fastattn_torch.attention(q, k, v, causal="bottom_right"), (q, k, v), eps=1e-6, atol=1e-6
    )
