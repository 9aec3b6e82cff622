"""The array layer: layouts, strides, dtypes, zero-copy conversion and framework interop.

DESIGN.md §3: layout "bshd" swaps axes 1 and 2 and costs no copy (kernels take strides; the last
axis must be contiguous, else one copy is made); outputs come back in q's dtype and framework, lse
float32 (float64 for float64 inputs); inputs may be numpy arrays or any DLPack producer.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import fastattn
from fastattn import _arrays, _validation
from fastattn._options import AttentionOptions

BF16 = np.dtype(ml_dtypes.bfloat16)
B, HQ, HKV, SQ, SK, D, DV = 2, 4, 2, 5, 7, 8, 6


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _qkv(dtype: Any = np.float32, seed: int = 0, *, sq: int = SQ, sk: int = SK) -> tuple[np.ndarray, ...]:
    rng = _rng(seed)
    q = rng.standard_normal((B, HQ, sq, D)).astype(dtype)
    k = rng.standard_normal((B, HKV, sk, D)).astype(dtype)
    v = rng.standard_normal((B, HKV, sk, DV)).astype(dtype)
    return q, k, v


def _oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float64 brute force (bhsd), with GQA by repeating kv heads."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        sq, sk = scores.shape[-2:]
        scores = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None], scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - row_max)
    total = p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p / total, v), (row_max + np.log(total))[..., 0]


def _to_bshd(x: np.ndarray) -> np.ndarray:
    """A C-contiguous (B, S, H, D) copy of a (B, H, S, D) array."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


# --------------------------------------------------------------------------------------------------
# numpy in, numpy out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_result_matches_oracle(dtype: Any, causal: bool) -> None:
    q, k, v = _qkv(dtype)
    out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True)
    assert type(out) is np.ndarray and type(lse) is np.ndarray
    assert out.shape == (B, HQ, SQ, DV) and lse.shape == (B, HQ, SQ)
    want_out, want_lse = _oracle(q, k, v, causal)
    tol = 1e-10 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(out, want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)


def test_inputs_are_not_written_by_successful_calls() -> None:
    q, k, v = _qkv(np.float32, seed=11)
    mask = _rng(12).standard_normal((1, HQ, SQ, SK)).astype(np.float32)
    lengths = np.array([SK, 3])
    copies = [x.copy() for x in (q, k, v, mask, lengths)]
    out, lse = fastattn.attention(q, k, v, mask=mask, key_lengths=lengths, return_lse=True)
    dout = _rng(13).standard_normal(out.shape).astype(np.float32)
    out_copy, lse_copy, dout_copy = out.copy(), lse.copy(), dout.copy()
    fastattn.attention_backward(dout, q, k, v, out, lse, mask=mask, key_lengths=lengths)
    for x, copy in zip((q, k, v, mask, lengths, out, lse, dout), copies + [out_copy, lse_copy, dout_copy]):
        assert np.array_equal(x, copy)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bshd_matches_transposed_bhsd(dtype: Any) -> None:
    q, k, v = _qkv(dtype, seed=1)
    out, lse = fastattn.attention(q, k, v, causal="bottom_right", return_lse=True)
    out_s, lse_s = fastattn.attention(
        _to_bshd(q), _to_bshd(k), _to_bshd(v), causal="bottom_right", layout="bshd", return_lse=True
    )
    assert out_s.shape == (B, SQ, HQ, DV)
    assert out_s.flags.c_contiguous
    assert lse_s.shape == (B, HQ, SQ)
    tol = 1e-12 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(out_s, out.transpose(0, 2, 1, 3), rtol=tol, atol=tol)
    np.testing.assert_allclose(lse_s, lse, rtol=tol, atol=tol)


def test_bshd_backward_matches_transposed_bhsd() -> None:
    q, k, v = _qkv(np.float64, seed=2)
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    dout = _rng(3).standard_normal(out.shape)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    grads_s = fastattn.attention_backward(
        _to_bshd(dout), _to_bshd(q), _to_bshd(k), _to_bshd(v), _to_bshd(out), lse, causal=True, layout="bshd"
    )
    for grad, grad_s, like in zip(grads, grads_s, (q, k, v)):
        assert grad_s.shape == _to_bshd(like).shape
        assert grad_s.flags.c_contiguous
        assert grad.flags.c_contiguous
        np.testing.assert_allclose(grad_s, grad.transpose(0, 2, 1, 3), rtol=1e-12, atol=1e-12)
        assert np.abs(grad).max() > 0


def _strided_variants(x: np.ndarray) -> dict[str, np.ndarray]:
    """Views of the values of ``x`` (B, H, S, D) with various memory layouts."""
    rng = _rng(x.size)
    b, h, s, d = x.shape
    doubled = np.empty((b, h, 2 * s, d), x.dtype)
    doubled[:, :, ::2] = x
    doubled[:, :, 1::2] = rng.standard_normal((b, h, s, d)).astype(x.dtype)
    bshd_memory = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    reversed_seq = np.ascontiguousarray(x[:, :, ::-1])[:, :, ::-1]
    wide = np.zeros((b, h, s, 2 * d), x.dtype)
    wide[..., ::2] = x
    variants = {
        "seq-step-2": doubled[:, :, ::2],
        "bshd-memory-transposed": bshd_memory,
        "fortran": np.asfortranarray(x),
        "reversed-seq": reversed_seq,
        "last-axis-step-2": wide[..., ::2],
    }
    for name, view in variants.items():
        assert np.array_equal(view, x), name
    assert not variants["seq-step-2"].flags.c_contiguous
    assert not variants["bshd-memory-transposed"].flags.c_contiguous
    assert variants["bshd-memory-transposed"].strides[-1] == x.itemsize
    assert variants["fortran"].strides[-1] != x.itemsize
    assert variants["last-axis-step-2"].strides[-1] == 2 * x.itemsize
    return variants


@pytest.mark.parametrize("which", ["q", "k", "v", "all"])
@pytest.mark.parametrize(
    "variant", ["seq-step-2", "bshd-memory-transposed", "fortran", "reversed-seq", "last-axis-step-2"]
)
def test_noncontiguous_inputs_match_contiguous_copies(which: str, variant: str) -> None:
    q, k, v = _qkv(np.float32, seed=4)
    mask = _rng(5).random((B, 1, SQ, SK)) > 0.3
    want, want_lse = fastattn.attention(q, k, v, mask=mask, causal=True, return_lse=True)
    arrays = {"q": q, "k": k, "v": v}
    for name in arrays if which == "all" else [which]:
        arrays[name] = _strided_variants(arrays[name])[variant]
    copies = {name: array.copy() for name, array in arrays.items()}
    got, got_lse = fastattn.attention(
        arrays["q"], arrays["k"], arrays["v"], mask=mask, causal=True, return_lse=True
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-6)
    for name, array in arrays.items():
        assert np.array_equal(array, copies[name])


@pytest.mark.parametrize("variant", ["seq-step-2", "fortran", "reversed-seq", "last-axis-step-2"])
def test_noncontiguous_backward_matches_contiguous(variant: str) -> None:
    q, k, v = _qkv(np.float64, seed=6)
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    dout = _rng(7).standard_normal(out.shape)
    want = fastattn.attention_backward(dout, q, k, v, out, lse)
    got = fastattn.attention_backward(
        *(_strided_variants(x)[variant] for x in (dout, q, k, v, out)), lse
    )
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_noncontiguous_bshd_inputs() -> None:
    """bshd inputs sliced along the sequence axis (axis 1 in bshd)."""
    q, k, v = _qkv(np.float32, seed=8)
    want = fastattn.attention(q, k, v, layout="bhsd")
    padded = []
    for x in (q, k, v):
        s = _to_bshd(x)
        big = np.zeros((s.shape[0], 3 * s.shape[1]) + s.shape[2:], s.dtype)
        big[:, ::3] = s
        padded.append(big[:, ::3])
    got = fastattn.attention(*padded, layout="bshd")
    assert got.flags.c_contiguous
    np.testing.assert_allclose(got, want.transpose(0, 2, 1, 3), rtol=1e-6, atol=1e-6)


def test_broadcast_kv_input_is_accepted() -> None:
    """A zero-stride (np.broadcast_to, read-only) kv input gives the result of its copy."""
    q, k, v = _qkv(np.float64, seed=9)
    k_b = np.broadcast_to(k[:, :1], k.shape)
    v_b = np.broadcast_to(v[:, :, :1], v.shape)
    assert not k_b.flags.writeable
    got = fastattn.attention(q, k_b, v_b)
    want = fastattn.attention(q, k_b.copy(), v_b.copy())
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("dtype", "lse_dtype", "tol"),
    [
        (BF16, np.float32, 3e-2),
        (np.float16, np.float32, 5e-3),
        (np.float32, np.float32, 1e-5),
        (np.float64, np.float64, 1e-10),
    ],
    ids=["bfloat16", "float16", "float32", "float64"],
)
def test_output_dtypes(dtype: Any, lse_dtype: Any, tol: float) -> None:
    q, k, v = _qkv(dtype, seed=10)
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    assert out.dtype == np.dtype(dtype)
    assert lse.dtype == np.dtype(lse_dtype)
    want_out, want_lse = _oracle(q, k, v)
    np.testing.assert_allclose(out.astype(np.float64), want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse.astype(np.float64), want_lse, rtol=tol, atol=tol)
    dout = _rng(11).standard_normal(out.shape).astype(dtype)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse)
    for grad, like in zip(grads, (q, k, v)):
        assert grad.dtype == np.dtype(dtype)
        assert grad.shape == like.shape


# --------------------------------------------------------------------------------------------------
# zero-copy helpers of the array layer (numpy)


def test_to_native_numpy_is_the_same_array() -> None:
    x = _qkv()[0][:, :, ::2]
    native, origin = _arrays.to_native(x, "q")
    assert native is x
    assert (origin.framework, origin.device, origin.device_id) == ("numpy", "cpu", 0)
    assert _arrays.from_native(native, origin) is native


def test_to_native_rejects_non_arrays_with_the_name() -> None:
    with pytest.raises(TypeError, match=r"^mask:"):
        _arrays.to_native([1.0, 2.0], "mask")


def test_swap_layout_is_a_view() -> None:
    x = _qkv()[0]
    swapped = _arrays.swap_layout(x, "bshd")
    assert swapped.shape == (B, SQ, HQ, D)
    assert np.shares_memory(swapped, x)
    assert swapped.base is not None
    assert np.array_equal(swapped, x.transpose(0, 2, 1, 3))
    assert _arrays.swap_layout(swapped, "bshd").shape == x.shape
    assert _arrays.swap_layout(x, "bhsd") is x


def test_bshd_inputs_reach_backends_without_copy() -> None:
    """bshd and strided inputs are viewed, not copied; only a non-contiguous last axis is copied."""
    q, k, v = (_to_bshd(x) for x in _qkv(np.float32, seed=12))
    call = _validation.prepare("forward", {"q": q, "k": k, "v": v}, AttentionOptions(layout="bshd"))
    for name, original in (("q", q), ("k", k), ("v", v)):
        native = call.arrays[name]
        assert np.shares_memory(native, original), name
        assert native.shape == original.transpose(0, 2, 1, 3).shape
    assert call.problem.q_strides == (SQ * HQ * D, D, HQ * D, 1)

    stepped = np.zeros((B, HQ, 2 * SQ, D), np.float32)[:, :, ::2]
    call = _validation.prepare("forward", {"q": stepped, "k": _qkv()[1], "v": _qkv()[2]}, AttentionOptions())
    assert np.shares_memory(call.arrays["q"], stepped)

    fortran = np.asfortranarray(_qkv()[0])
    call = _validation.prepare("forward", {"q": fortran, "k": _qkv()[1], "v": _qkv()[2]}, AttentionOptions())
    assert not np.shares_memory(call.arrays["q"], fortran)
    assert call.arrays["q"].strides[-1] == fortran.itemsize
    assert np.array_equal(call.arrays["q"], fortran)


# --------------------------------------------------------------------------------------------------
# DLPack-only producers


class DLPackOnly:
    """Exposes only the DLPack protocol, delegating to a numpy array."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()


def test_dlpack_only_object_is_accepted() -> None:
    q, k, v = _qkv(np.float32, seed=13)
    mask = _rng(14).random((SQ, SK)) > 0.2
    want = fastattn.attention(q, k, v, mask=mask)
    wrapped = [DLPackOnly(x) for x in (q, k, v)]
    assert not isinstance(wrapped[0], np.ndarray) and not hasattr(wrapped[0], "shape")
    got = fastattn.attention(*wrapped, mask=DLPackOnly(mask))
    np.testing.assert_array_equal(np.asarray(got), want)
    native, origin = _arrays.to_native(wrapped[0], "q")
    assert np.shares_memory(native, q)
    assert origin.device == "cpu"


# --------------------------------------------------------------------------------------------------
# torch


def _torch() -> Any:
    return pytest.importorskip("torch")


def _torch_dtype(torch: Any, name: str) -> Any:
    return getattr(torch, name)


def _np_of(tensor: Any) -> np.ndarray:
    """numpy array with the same bits (bf16 through int16 into ml_dtypes.bfloat16)."""
    torch = _torch()
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BF16).copy()
    return tensor.numpy().copy()


TORCH_DTYPES = [("float32", 1e-6), ("float64", 1e-12), ("bfloat16", 1e-2), ("float16", 1e-3)]


@pytest.mark.parametrize(("dtype_name", "tol"), TORCH_DTYPES, ids=[d for d, _ in TORCH_DTYPES])
def test_torch_in_torch_out(dtype_name: str, tol: float) -> None:
    torch = _torch()
    dtype = _torch_dtype(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, SQ, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, SK, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, SK, DV, generator=gen).to(dtype)
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.dtype == dtype and tuple(out.shape) == (B, HQ, SQ, DV)
    assert lse.dtype == (torch.float64 if dtype_name == "float64" else torch.float32)
    assert out.device.type == "cpu"
    want, want_lse = fastattn.attention(_np_of(q), _np_of(k), _np_of(v), causal=True, return_lse=True)
    np.testing.assert_allclose(_np_of(out).astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    np.testing.assert_allclose(_np_of(lse), want_lse, rtol=tol, atol=tol)


def test_torch_bf16_matches_ml_dtypes_bits_and_oracle() -> None:
    torch = _torch()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(*shape, generator=gen).bfloat16() for shape in ((B, HQ, SQ, D), (B, HKV, SK, D), (B, HKV, SK, DV))
    )
    out = fastattn.attention(q, k, v)
    want = fastattn.attention(_np_of(q), _np_of(k), _np_of(v))
    assert want.dtype == BF16
    np.testing.assert_array_equal(_np_of(out).view(np.int16), want.view(np.int16))
    oracle, _ = _oracle(_np_of(q), _np_of(k), _np_of(v))
    np.testing.assert_allclose(out.float().numpy(), oracle, rtol=3e-2, atol=3e-2)


def test_torch_requires_grad_is_accepted_and_untouched() -> None:
    torch = _torch()
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, HQ, SQ, D, generator=gen, requires_grad=True)
    k = torch.randn(B, HKV, SK, D, generator=gen, requires_grad=True)
    v = torch.randn(B, HKV, SK, DV, generator=gen, requires_grad=True)
    copies = [x.detach().clone() for x in (q, k, v)]
    out = fastattn.attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    for x, copy in zip((q, k, v), copies):
        assert torch.equal(x.detach(), copy)
        assert x.requires_grad and x.grad is None
    want = fastattn.attention(*(c.numpy() for c in copies))
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_torch_backward_returns_torch(dtype_name: str) -> None:
    torch = _torch()
    dtype = _torch_dtype(torch, dtype_name)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, SQ, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, SK, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, SK, DV, generator=gen).to(dtype)
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    dout = torch.randn(B, HQ, SQ, DV, generator=gen).to(dtype)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse)
    want = fastattn.attention_backward(*(_np_of(x) for x in (dout, q, k, v, out, lse)))
    for grad, w, like in zip(grads, want, (q, k, v)):
        assert isinstance(grad, torch.Tensor)
        assert grad.dtype == dtype and grad.shape == like.shape
        np.testing.assert_array_equal(_np_of(grad).astype(np.float64), w.astype(np.float64))


def test_torch_backward_matches_autograd() -> None:
    """Gradients through torch tensors agree with torch's own autograd of the same math."""
    torch = _torch()
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(B, HQ, SQ, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, HKV, SK, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, HKV, SK, DV, generator=gen, dtype=torch.float64, requires_grad=True)
    group = HQ // HKV
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / D**0.5
    expected = torch.softmax(scores, -1) @ v.repeat_interleave(group, 1)
    dout = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    expected.backward(dout)
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-10)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse)
    for grad, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-10)


def test_torch_noncontiguous_and_bshd() -> None:
    torch = _torch()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, SQ, HQ, D, generator=gen)  # bshd memory
    k = torch.randn(B, SK, HKV, D, generator=gen)
    v = torch.randn(B, SK, HKV, DV, generator=gen)
    out_s = fastattn.attention(q, k, v, layout="bshd")
    assert isinstance(out_s, torch.Tensor) and out_s.is_contiguous()
    assert tuple(out_s.shape) == (B, SQ, HQ, DV)
    views = [x.transpose(1, 2) for x in (q, k, v)]  # bhsd views, last axis contiguous
    assert not views[0].is_contiguous()
    out = fastattn.attention(*views)
    want = fastattn.attention(*(x.contiguous().numpy() for x in views))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out_s.numpy(), want.transpose(0, 2, 1, 3), rtol=1e-6, atol=1e-6)
    stepped = torch.randn(B, HQ, SQ, 2 * D, generator=gen)[..., ::2]  # last axis not contiguous
    np.testing.assert_allclose(
        fastattn.attention(stepped, views[1], views[2]).numpy(),
        fastattn.attention(stepped.contiguous().numpy(), *(x.contiguous().numpy() for x in views[1:])),
        rtol=1e-6,
        atol=1e-6,
    )


def test_torch_mask_and_key_lengths() -> None:
    torch = _torch()
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(B, HQ, SQ, D, generator=gen)
    k = torch.randn(B, HKV, SK, D, generator=gen)
    v = torch.randn(B, HKV, SK, DV, generator=gen)
    mask = torch.rand(B, 1, SQ, SK, generator=gen) > 0.3
    lengths = torch.tensor([SK, 4], dtype=torch.int32)
    out = fastattn.attention(q, k, v, mask=mask, key_lengths=lengths)
    want = fastattn.attention(q.numpy(), k.numpy(), v.numpy(), mask=mask.numpy(), key_lengths=lengths.numpy())
    unmasked = fastattn.attention(q.numpy(), k.numpy(), v.numpy())
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(want, unmasked)


@pytest.mark.parametrize("dtype_name", ["float32", "float64", "float16", "bfloat16"])
def test_to_native_torch_shares_memory(dtype_name: str) -> None:
    torch = _torch()
    dtype = _torch_dtype(torch, dtype_name)
    tensor = torch.randn(B, SQ, HQ, D, generator=torch.Generator().manual_seed(7)).to(dtype).transpose(1, 2)
    native, origin = _arrays.to_native(tensor, "q")
    assert isinstance(native, np.ndarray)
    assert (origin.framework, origin.device) == ("torch", "cpu")
    assert native.ctypes.data == tensor.data_ptr()
    assert native.__array_interface__["data"][0] == tensor.data_ptr()
    assert native.shape == tuple(tensor.shape)
    assert native.strides == tuple(s * tensor.element_size() for s in tensor.stride())
    assert native.dtype == (BF16 if dtype_name == "bfloat16" else np.dtype(dtype_name))
    np.testing.assert_array_equal(native.astype(np.float64), tensor.double().numpy())


def test_to_native_torch_requires_grad_shares_memory() -> None:
    torch = _torch()
    tensor = torch.randn(B, HQ, SQ, D, requires_grad=True)
    native, _ = _arrays.to_native(tensor, "q")
    assert native.ctypes.data == tensor.data_ptr()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16], ids=["f32", "f64", "f16", "bf16"])
def test_from_native_to_torch_shares_memory(dtype: Any) -> None:
    torch = _torch()
    native = _rng(8).standard_normal((B, HQ, SQ, D)).astype(dtype)
    origin = _arrays.to_native(torch.zeros(1), "q")[1]
    tensor = _arrays.from_native(native, origin)
    assert isinstance(tensor, torch.Tensor)
    assert tensor.data_ptr() == native.ctypes.data
    assert tuple(tensor.shape) == native.shape
    expected_dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                      np.dtype(np.float16): torch.float16, BF16: torch.bfloat16}[np.dtype(dtype)]
    assert tensor.dtype == expected_dtype
    np.testing.assert_array_equal(_np_of(tensor).astype(np.float64), native.astype(np.float64))
    native[0, 0, 0, 0] = 42  # the same memory: the tensor sees the write
    assert float(tensor[0, 0, 0, 0]) == 42.0


def test_from_native_to_torch_keeps_strides_of_a_view() -> None:
    torch = _torch()
    origin = _arrays.to_native(torch.zeros(1), "q")[1]
    buffer = _rng(9).standard_normal((B, SQ, HQ, D)).astype(np.float32)
    view = buffer.swapaxes(1, 2)
    tensor = _arrays.from_native(view, origin)
    assert tensor.data_ptr() == buffer.ctypes.data
    assert tuple(tensor.stride()) == tuple(s // 4 for s in view.strides)
    np.testing.assert_array_equal(tensor.numpy(), view)


#: A fresh interpreter: float32 calls (numpy, and torch where installed) leave ml_dtypes unimported;
#: the first bfloat16 input (a torch tensor through the DLPack view, else a name) imports it and
#: still gets a bfloat16 result, which the test holds against the float64 oracle (inputs: seed 11).
_LAZY_ML_DTYPES = """
import json, sys
import numpy as np
import fastattn
report = {"after_import": "ml_dtypes" in sys.modules}
rng = np.random.default_rng(11)
q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(3))
out = fastattn.attention(q, k, v, backend="cpu")
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    fastattn.attention(*(torch.from_numpy(x) for x in (q, k, v)), backend="cpu")
report["after_float32"] = "ml_dtypes" in sys.modules
if torch is not None:
    result = fastattn.attention(*(torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v)), backend="cpu")
    report["bf16_dtype"] = str(result.dtype)
    values = result.float().numpy()
else:
    bf16 = fastattn._arrays.numpy_dtype("bfloat16")
    result = fastattn.attention(q.astype(bf16), k.astype(bf16), v.astype(bf16), backend="cpu")
    report["bf16_dtype"] = str(result.dtype)
    values = result.astype(np.float32)
report["bf16_values"] = values.tolist()
report["after_bfloat16"] = "ml_dtypes" in sys.modules
print(json.dumps(report))
"""


def test_ml_dtypes_is_imported_by_the_first_bfloat16_input_only() -> None:
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _LAZY_ML_DTYPES], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["after_import"] is False
    assert report["after_float32"] is False
    assert report["bf16_dtype"] in ("torch.bfloat16", "bfloat16")
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(3))
    expected, _ = _oracle(q, k, v)
    assert float(np.abs(np.asarray(report["bf16_values"]) - expected).max()) < 3e-2
    assert report["after_bfloat16"] is True
