"""Mask arrays on the CPU kernels (mask_tiles.h) against the float64 oracle, and key-prefix masks
run as ``key_lengths``.

The kernels read a mask three ways: one mask row broadcast to every row of a score tile (a
(B,1,1,Sk) mask), blocks of rows transposed in registers (rows that differ), and row by row along
the keys (the decode path); and they skip tiles a bool mask hides entirely.  Each case here is built
so that one of those paths runs with more than one key tile and a key tail, at every instruction-set
level this machine runs, with fresh random inputs and NaN-poisoned outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import fastattn
from fastattn import _arrays, _validation
from fastattn._cpu import isa
from fastattn._options import AttentionOptions

from ._poison import poisoned_allocator
from .conformance import _oracle
from .conformance._cases import BACKWARD_TOLERANCE, FORWARD_TOLERANCE, relative_error

B, HQ, HKV, D = 2, 4, 2, 24

MaskMaker = Callable[[np.random.Generator, int, int], np.ndarray]


def _bool(shape: Callable[[int, int], tuple[int, ...]]) -> MaskMaker:
    return lambda rng, sq, sk: rng.random(shape(sq, sk)) >= 0.15


def _float(shape: Callable[[int, int], tuple[int, ...]], dtype: Any) -> MaskMaker:
    def make(rng: np.random.Generator, sq: int, sk: int) -> np.ndarray:
        values = rng.standard_normal(shape(sq, sk))
        values[rng.random(values.shape) < 0.15] = -np.inf
        return values.astype(dtype)

    return make


def _hidden_tiles(rng: np.random.Generator, sq: int, sk: int) -> np.ndarray:
    """A full bool mask that also hides keys 64..127 from every query: whole tiles to skip."""
    mask = rng.random((B, HQ, sq, sk)) >= 0.15
    mask[..., 64:128] = False
    return mask


def _minus_inf_tile(rng: np.random.Generator, sq: int, sk: int) -> np.ndarray:
    """A (B,1,1,Sk) float mask that is -inf on keys 0..63 (computed, not skipped: -inf added to a
    NaN score is NaN, and that must reach the row)."""
    values = rng.standard_normal((B, 1, 1, sk)).astype(np.float32)
    values[..., :64] = -np.inf
    return values


def _strided_keys(rng: np.random.Generator, sq: int, sk: int) -> np.ndarray:
    """Every other key of a wider mask: the key axis is not contiguous."""
    return (rng.random((B, HQ, sq, 2 * sk)) >= 0.15)[..., ::2]


def _reversed_queries(rng: np.random.Generator, sq: int, sk: int) -> np.ndarray:
    """A full float mask viewed with a negative query stride."""
    return _float(lambda sq, sk: (B, HQ, sq, sk), np.float32)(rng, sq, sk)[:, :, ::-1]


def _rows_hidden(rng: np.random.Generator, sq: int, sk: int) -> np.ndarray:
    """(Sq, 1): each query sees every key or none (the key axis broadcasts)."""
    rows = rng.random((sq, 1)) >= 0.3
    rows[0] = False
    return rows


MASKS: dict[str, MaskMaker] = {
    "bool-keys": _bool(lambda sq, sk: (B, 1, 1, sk)),
    "bool-heads": _bool(lambda sq, sk: (B, HQ, 1, sk)),
    "bool-full": _bool(lambda sq, sk: (B, HQ, sq, sk)),
    "bool-queries": _bool(lambda sq, sk: (1, 1, sq, sk)),
    "float32-full": _float(lambda sq, sk: (B, HQ, sq, sk), np.float32),
    "float32-keys": _float(lambda sq, sk: (B, 1, 1, sk), np.float32),
    "float64-queries": _float(lambda sq, sk: (sq, sk), np.float64),
    "float16-full": _float(lambda sq, sk: (B, HQ, sq, sk), np.float16),
    "bfloat16-heads": _float(lambda sq, sk: (B, HQ, sq, sk), ml_dtypes.bfloat16),
    "bool-hidden-tiles": _hidden_tiles,
    "float-minus-inf-tile": _minus_inf_tile,
    "bool-strided-keys": _strided_keys,
    "float-reversed-queries": _reversed_queries,
    "bool-rows": _rows_hidden,
}


@pytest.fixture(autouse=True)
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_arrays, "empty_bhsd", poisoned_allocator())


@pytest.fixture
def restore_level() -> Iterator[None]:
    before = isa.active()
    yield
    isa.select(before)


def _oracle_mask(mask: np.ndarray) -> np.ndarray:
    return mask if mask.dtype == np.bool_ else mask.astype(np.float64)


def check_against_oracle(
    mask_name: str, dtype: Any, seq_q: int, seq_k: int, causal: Any = False, head_dim: int = D
) -> None:
    rng = np.random.default_rng()
    q, dout = (rng.standard_normal((B, HQ, seq_q, head_dim)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, HKV, seq_k, head_dim)).astype(dtype) for _ in range(2))
    mask = MASKS[mask_name](rng, seq_q, seq_k)
    call = {"mask": mask, "causal": causal, "backend": "cpu"}
    out, lse = fastattn.attention(q, k, v, return_lse=True, **call)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse, **call)

    exact = [x.astype(np.float64) for x in (q, k, v, dout)]
    options = _oracle.Options(causal=causal, mask=_oracle_mask(mask))
    expected_out, expected_lse = _oracle.forward(*exact[:3], options)
    name = np.dtype(dtype).name
    assert relative_error(out.astype(np.float64), expected_out) <= FORWARD_TOLERANCE[name]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    visible = ~np.isneginf(expected_lse)
    np.testing.assert_allclose(lse[visible], expected_lse[visible], rtol=FORWARD_TOLERANCE[name], atol=1e-4)
    expected = _oracle.backward(exact[3], *exact[:3], options, out=out.astype(np.float64))
    for grad, want, size in zip(grads, expected[:3], expected.magnitudes):
        assert relative_error(grad.astype(np.float64), want, size) <= BACKWARD_TOLERANCE[name]


@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_each_mask_layout_matches_the_oracle(mask_name: str) -> None:
    check_against_oracle(mask_name, np.float32, seq_q=40, seq_k=150)


@pytest.mark.parametrize("mask_name", ["bool-full", "float32-keys", "bool-hidden-tiles", "float16-full"])
@pytest.mark.parametrize("dtype", [np.float64, ml_dtypes.bfloat16])
def test_masks_in_other_compute_types(mask_name: str, dtype: Any) -> None:
    check_against_oracle(mask_name, dtype, seq_q=40, seq_k=150, causal="bottom_right")


@pytest.mark.parametrize(
    "mask_name", ["bool-full", "float32-full", "bool-keys", "bool-hidden-tiles", "bool-strided-keys"]
)
@pytest.mark.parametrize("seq_q", [1, 3])
def test_masks_on_the_decode_path(mask_name: str, seq_q: int) -> None:
    check_against_oracle(mask_name, np.float32, seq_q=seq_q, seq_k=200)


@pytest.mark.parametrize("name", isa.runnable())
@pytest.mark.parametrize("mask_name", ["bool-full", "float16-full", "bool-keys", "bool-hidden-tiles"])
def test_masks_at_every_level(name: str, mask_name: str, restore_level: None) -> None:
    isa.select(name)
    check_against_oracle(mask_name, np.float32, seq_q=37, seq_k=150, causal=True)


@pytest.mark.parametrize("name", isa.runnable())
@pytest.mark.parametrize("mask_name", ["bool-full", "bool-keys", "bfloat16-heads", "float16-full"])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_masks_on_the_half_precision_kernels(
    name: str, mask_name: str, dtype: Any, causal: Any, restore_level: None
) -> None:
    """Head dim 64, where the half-precision forwards run on bfloat16 units (AMX, ``vdpbf16ps``) and
    their softmax takes a bool mask as bits, a bfloat16 one as words and a (B,1,1,Sk) one per key
    (a float16 one takes the mask pass): 140 rows a kv head (ten row vectors, the ninth partly and
    the tenth wholly padded), 300 keys (a whole tile, then 2 blocks of 16 and a 12-key tail).
    Causal, every tile has an edge: bool masks fold it into their bits, the others take the pass."""
    isa.select(name)
    check_against_oracle(mask_name, dtype, seq_q=70, seq_k=300, causal=causal, head_dim=64)


def _problem_of(mask: np.ndarray, lengths: np.ndarray | None = None) -> Any:
    rng = np.random.default_rng()
    q = rng.standard_normal((B, HQ, 8, D), dtype=np.float32)
    k = rng.standard_normal((B, HKV, 150, D), dtype=np.float32)
    options = AttentionOptions(mask=mask, key_lengths=lengths)
    return _validation.prepare("forward", {"q": q, "k": k, "v": k}, options)


def test_a_key_prefix_mask_runs_as_key_lengths() -> None:
    lengths = np.array([97, 150])
    mask = (np.arange(150) < lengths[:, None]).reshape(B, 1, 1, 150)
    call = _problem_of(mask)
    assert call.problem.mask is None and call.problem.has_key_lengths
    np.testing.assert_array_equal(call.extras.key_lengths, lengths)
    assert call.extras.mask is None

    with_lengths = _problem_of(mask, np.array([120, 60], dtype=np.int32))
    np.testing.assert_array_equal(with_lengths.extras.key_lengths, [97, 60])

    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((B, h, 30, D), dtype=np.float32) for h in (HQ, HKV, HKV))
    k, v = (np.concatenate([x] * 5, axis=2) for x in (k, v))
    by_mask = fastattn.attention(q, k, v, mask=mask, backend="cpu")
    by_lengths = fastattn.attention(q, k, v, key_lengths=lengths, backend="cpu")
    np.testing.assert_array_equal(by_mask, by_lengths)


@pytest.mark.parametrize(
    "mask",
    [
        (np.arange(150) < 97) & (np.arange(150) != 3),  # a hole inside the prefix
        np.arange(150) >= 10,  # a suffix
        np.ones((B, HQ, 1, 150), dtype=bool),  # per head: not inspected
        np.where(np.arange(150) < 97, 0.0, -np.inf).astype(np.float32),  # float: not inspected
    ],
    ids=["hole", "suffix", "per-head", "float"],
)
def test_other_masks_stay_masks(mask: np.ndarray) -> None:
    call = _problem_of(mask)
    assert call.problem.mask is not None and not call.problem.has_key_lengths
    assert call.extras.mask is not None


def test_prefix_lengths_of_broadcast_masks() -> None:
    seq_k = 12
    assert _validation.key_prefix_lengths(np.ones((1, 1, 1, 1), bool), 3, seq_k).tolist() == [12] * 3
    assert _validation.key_prefix_lengths(np.zeros((1, 1, 1, 1), bool), 2, seq_k).tolist() == [0, 0]
    prefix = (np.arange(seq_k) < 5).reshape(1, 1, 1, seq_k)
    assert _validation.key_prefix_lengths(prefix, 2, seq_k).tolist() == [5, 5]
