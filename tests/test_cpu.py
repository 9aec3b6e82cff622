"""The cpu backend's own guarantees: thread control, determinism, the split-KV decode path, bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn._cpu import _flash, isa
from fastattn.backends import cpu as cpu_backend
from fastattn.nn import KVCache

from .conformance import _oracle
from .conformance._cases import (
    BACKWARD_TOLERANCE,
    FORWARD_TOLERANCE,
    Case,
    bhsd_float64,
    make_inputs,
    relative_error,
)
from .conformance.test_forward import check_forward

pytestmark = pytest.mark.skipif(
    not fastattn.backends.available()["cpu"].available, reason="the cpu backend is unavailable"
)


@pytest.fixture
def threads():
    """Restore the thread count after a test changes it."""
    before = fastattn.get_num_threads()
    yield
    fastattn.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -2])
def test_set_num_threads_rejects_counts_below_one(bad: int) -> None:
    with pytest.raises(ValueError, match="^n:"):
        fastattn.set_num_threads(bad)


@pytest.mark.parametrize("bad", [1.5, "2", True, None])
def test_set_num_threads_rejects_non_integers(bad) -> None:
    with pytest.raises(TypeError, match="^n:"):
        fastattn.set_num_threads(bad)


def test_thread_count_changes_nothing_but_speed(threads) -> None:
    """Each work item is computed by one thread, so the forward is bit-identical at any count."""
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 8, 300, 64), dtype=np.float32)
    k = rng.standard_normal((2, 2, 280, 64), dtype=np.float32)
    v = rng.standard_normal((2, 2, 280, 48), dtype=np.float32)
    results = []
    for count in (1, 2, 3):
        fastattn.set_num_threads(count)
        assert fastattn.get_num_threads() == count
        results.append(fastattn.attention(q, k, v, causal="bottom_right", backend="cpu", return_lse=True))
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])


def test_backward_is_bit_identical_at_any_thread_count(threads) -> None:
    """Every gradient element is written by one work item in a fixed order: no thread races."""
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 8, 200, 64), dtype=np.float32)
    k = rng.standard_normal((2, 2, 230, 64), dtype=np.float32)
    v = rng.standard_normal((2, 2, 230, 32), dtype=np.float32)
    out, lse = fastattn.attention(q, k, v, causal="bottom_right", return_lse=True, backend="cpu")
    dout = rng.standard_normal(out.shape, dtype=np.float32)
    results = []
    for count in (1, 2, 3, 2):
        fastattn.set_num_threads(count)
        results.append(fastattn.attention_backward(dout, q, k, v, out, lse, causal="bottom_right", backend="cpu"))
    for grads in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(grads, results[0]))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_deterministic_flag_changes_nothing_where_always_deterministic(backend: str) -> None:
    """attention_backward(deterministic=True) is accepted and gives the very same gradients."""
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 4, 70, 32), dtype=np.float32)
    k = rng.standard_normal((1, 2, 90, 32), dtype=np.float32)
    v = rng.standard_normal((1, 2, 90, 16), dtype=np.float32)
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    dout = rng.standard_normal(out.shape, dtype=np.float32)
    plain = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend)
    pinned = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend, deterministic=True)
    assert all(np.array_equal(a, b) for a, b in zip(plain, pinned))


@settings(max_examples=60, deadline=None)
@given(
    seq_q=st.integers(1, cpu_backend.DECODE_MAX_QUERIES),
    seq_k=st.integers(1, 1500),
    group=st.sampled_from([1, 2, 4, 8]),
    threads_count=st.integers(1, 6),
    causal=st.sampled_from([False, "bottom_right"]),
    window=st.one_of(st.none(), st.tuples(st.integers(-1, 700), st.just(0))),
    with_lengths=st.booleans(),
    dtype=st.sampled_from(["float32", "float64"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_decode_split_keys_match_reference(
    seq_q, seq_k, group, threads_count, causal, window, with_lengths, dtype, seed
) -> None:
    """Few (batch, kv head) items and many keys: the keys are split across threads and merged."""
    before = fastattn.get_num_threads()
    fastattn.set_num_threads(threads_count)
    try:
        rng = np.random.default_rng(seed)
        q = rng.standard_normal((1, group, seq_q, 64)).astype(dtype)
        k = rng.standard_normal((1, 1, seq_k, 64)).astype(dtype)
        v = rng.standard_normal((1, 1, seq_k, 32)).astype(dtype)
        lengths = np.array([rng.integers(0, seq_k + 1)]) if with_lengths else None
        options = {"causal": causal, "window": window, "key_lengths": lengths}
        problem = fastattn.explain(q, k, v, **options).problem
        out, lse = fastattn.attention(q, k, v, backend="cpu", return_lse=True, **options)
        ref_out, ref_lse = fastattn.attention(
            *(x.astype(np.float64) for x in (q, k, v)), backend="reference", return_lse=True, **options
        )
    finally:
        fastattn.set_num_threads(before)
    tolerance = 1e-10 if dtype == "float64" else 1e-5
    assert cpu_backend.plan(problem, threads_count)[0] == seq_q
    scale = max(np.linalg.norm(ref_out), 1e-300)
    assert np.linalg.norm(out - ref_out) / scale <= tolerance
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.allclose(lse[finite], ref_lse[finite], rtol=tolerance, atol=tolerance)
    assert np.all(out[np.isneginf(ref_lse)] == 0)


def test_plan_splits_keys_only_when_threads_would_idle() -> None:
    def problem(batch, heads_kv, seq_q, seq_k):
        q = np.zeros((batch, heads_kv * 4, seq_q, 16), np.float32)
        k = np.zeros((batch, heads_kv, seq_k, 16), np.float32)
        return fastattn.explain(q, k, k).problem

    assert cpu_backend.plan(problem(8, 8, 1, 4096), 2) == (1, 1)
    assert cpu_backend.plan(problem(1, 1, 1, 4096), 8)[1] == 16
    assert cpu_backend.plan(problem(1, 1, 1, 10), 8)[1] == 1
    assert cpu_backend.plan(problem(1, 2, 512, 512), 2) == (cpu_backend.TILE_ROWS // 4, 1)


#: Token-major decodes, run over groups of kv heads (3 kv heads of GQA group 2, 1 query, 701 keys:
#: a partial last tile of HEAD_GROUP_KEY_TILE keys, D = 64, Dv = 96) with each contract feature.
HEAD_GROUP_CASES = {
    "plain": {},
    "value-dim-48": {"head_dim_v": 48},
    "gqa-4-two-queries-causal": {"group": 4, "seq_q": 2, "causal": "bottom_right"},
    "key-lengths-window-softcap": {"key_lengths": (701, 130), "window": (200, 0), "causal": "bottom_right",
                                   "softcap": 6.0},
    "full-bool-mask": {"mask_kind": "bool", "mask_shape": (2, 6, 1, 701)},
    "float-key-mask": {"mask_kind": "float", "mask_shape": (2, 1, 1, 701)},
    "strided-views": {"strided": "strided"},
    "one-batch-row-split-keys": {"batch": 1, "key_lengths": (513,)},
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("options", list(HEAD_GROUP_CASES.values()), ids=list(HEAD_GROUP_CASES))
def test_token_major_decode_over_kv_head_groups_matches_oracle(options, dtype, threads) -> None:
    """``layout="bshd"`` decodes on the float32-vector and `vdpbf16ps` kernels take every kv head in
    one item, tile by tile (``forward_heads``): the contiguous-run prefetch where the heads lie back
    to back, the next head's rows where they do not (strided views), split keys for a single batch
    row.  (The amx level's decode runs head by head.)"""
    base = {
        "batch": 2, "heads_kv": 3, "group": 2, "seq_q": 1, "seq_k": 701, "head_dim": 64, "head_dim_v": 96,
        "dtype": dtype, "layout": "bshd", "causal": False, "window": None, "mask_kind": None,
        "mask_shape": None, "key_lengths": None, "softcap": None, "scale": None, "strided": "contiguous",
        "seed": int(np.random.default_rng().integers(2**32)),
    }
    case = Case(**{**base, **options})
    numpy_dtype = fastattn._arrays.numpy_dtype(dtype)
    q = np.zeros((case.batch, case.seq_q, case.heads_q, case.head_dim), numpy_dtype)
    k = np.zeros((case.batch, case.seq_k, case.heads_kv, case.head_dim), numpy_dtype)
    v = np.zeros((case.batch, case.seq_k, case.heads_kv, case.head_dim_v), numpy_dtype)
    problem = fastattn.explain(q, k, v, layout="bshd").problem
    kernel = _flash.forward_kernel(problem, case.seq_q, cpu_backend.KEY_TILE)
    pairs = dtype == "bfloat16" and case.head_dim_v % 32 == 0
    expected_kernel = {"avx512bf16": "dpbf16-decode", "amx": "amx-decode"}.get(isa.active(), "vector-decode")
    assert kernel == (expected_kernel if pairs else "vector-decode")
    grouped = kernel in ("vector-decode", "dpbf16-decode")
    assert cpu_backend.decode_head_group(problem, cpu_backend.KEY_TILE) == (case.heads_kv if grouped else 1)
    expected_tile = cpu_backend.HEAD_GROUP_KEY_TILE if grouped else cpu_backend.KEY_TILE
    assert cpu_backend.tile_sizes(problem, 2) == (cpu_backend.TILE_ROWS, expected_tile)
    if case.batch == 1:
        assert cpu_backend.plan(problem, 2)[1] > 1, "expected the keys split across threads"
    fastattn.set_num_threads(2)
    check_forward("cpu", "cpu", case)


def test_head_major_views_decode_head_by_head() -> None:
    """A KVCache's views are "bshd" arrays over head-major memory: each head's tokens are one run
    already, so its decode keeps one kv head per item (and the usual key tile)."""
    cache = KVCache(2, 300, 4, 64)
    cache.append(*(np.ones((2, 300, 4, 64), np.float32) for _ in range(2)))
    problem = fastattn.explain(np.ones((2, 1, 8, 64), np.float32), *cache.view(), layout="bshd").problem
    assert cpu_backend.decode_head_group(problem, cpu_backend.KEY_TILE) == 1
    assert cpu_backend.tile_sizes(problem, 2) == (cpu_backend.TILE_ROWS, cpu_backend.KEY_TILE)


#: forward_block's tiles with O kept by row (AVX-512: half-precision inputs, or one row block of
#: float32) and transposed (two row blocks of float32): rows 12 (group 4, Sq 3), 32, 64 and a
#: prefill, value dims that leave 2-vector, 1-vector and element-by-element column passes.
ROW_BLOCK_CASES = {
    "rows-12-causal-dv-80": {"seq_q": 3, "head_dim_v": 80, "causal": "bottom_right"},
    "rows-16-window-softcap-dv-24": {"seq_q": 4, "head_dim_v": 24, "window": (90, 0), "causal": "bottom_right",
                                     "softcap": 5.0},
    "rows-32-key-lengths-float-mask": {"seq_q": 8, "key_lengths": (301, 77), "mask_kind": "float",
                                       "mask_shape": (2, 1, 1, 301)},
    "rows-64-bool-mask-dv-40": {"seq_q": 16, "head_dim_v": 40, "mask_kind": "bool", "mask_shape": (2, 8, 16, 301)},
    "prefill-causal-strided": {"seq_q": 150, "causal": True, "strided": "strided"},
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("options", list(ROW_BLOCK_CASES.values()), ids=list(ROW_BLOCK_CASES))
def test_row_blocks_of_the_vector_forward_match_oracle(options, dtype, threads) -> None:
    """The rows-as-lanes forward (``forward_block``) with more rows than the decode's dot products
    take, each way it keeps O: 2 kv heads of group 4, 301 keys (a partial last tile), D = 64.  (At
    the amx level bfloat16 and float16 items with Dv a multiple of 16 run on AMX tiles instead.)"""
    base = {
        "batch": 2, "heads_kv": 2, "group": 4, "seq_q": 3, "seq_k": 301, "head_dim": 64, "head_dim_v": 64,
        "dtype": dtype, "layout": "bhsd", "causal": False, "window": None, "mask_kind": None,
        "mask_shape": None, "key_lengths": None, "softcap": None, "scale": None, "strided": "contiguous",
        "seed": int(np.random.default_rng().integers(2**32)),
    }
    case = Case(**{**base, **options})
    problem = _problem_of(case)
    rows = case.group * min(case.seq_q, cpu_backend.TILE_ROWS // case.group)
    on_pairs = (dtype == "bfloat16" and isa.active() in ("avx512bf16", "amx")) or (
        dtype == "float16" and isa.active() == "amx"
    )
    if not on_pairs:
        assert _flash.forward_kernel(problem, rows, cpu_backend.KEY_TILE) == "vector"
    fastattn.set_num_threads(2)
    check_forward("cpu", "cpu", case)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("seq_q", [4, 16, 100])
def test_row_blocks_skip_non_finite_values_at_hidden_keys(seq_q: int, dtype: str) -> None:
    """Infinite and NaN V rows at keys a boolean mask hides share their tiles with visible keys: the
    forward's rerun that skips zero weights keeps them out of every row (O by row and transposed)."""
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 8, seq_q, 64)).astype(dtype)
    k = rng.standard_normal((2, 2, 200, 64)).astype(dtype)
    v = rng.standard_normal((2, 2, 200, 48)).astype(dtype)
    v[:, 0, 40:60] = np.inf
    v[:, 1, 40:60] = np.nan
    mask = np.ones((2, 1, 1, 200), bool)
    mask[..., 40:60] = False
    out = fastattn.attention(q, k, v, mask=mask, backend="cpu")
    with np.errstate(invalid="ignore"):
        expected = fastattn.attention(*(x.astype(np.float64) for x in (q, k, v)), mask=mask, backend="reference")
    assert np.isfinite(out).all()
    assert relative_error(out.astype(np.float64), expected) <= FORWARD_TOLERANCE[dtype]


def _bfloat16_case(options: dict, **fields) -> Case:
    """A bfloat16 case of 2 batch rows x 2 kv heads (group 2, 300 positions, 600 keys, D = Dv = 64 by
    default), ``fields`` then ``options`` over that, a fresh seed."""
    base = {
        "batch": 2, "heads_kv": 2, "group": 2, "seq_q": 300, "seq_k": 600, "head_dim": 64, "head_dim_v": 64,
        "dtype": "bfloat16", "layout": "bhsd", "causal": False, "window": None, "mask_kind": None,
        "mask_shape": None, "key_lengths": None, "softcap": None, "scale": None, "strided": "contiguous",
        "seed": int(np.random.default_rng().integers(2**32)),
    }
    return Case(**{**base, **fields, **options})


def _problem_of(case: Case):
    """The validated problem of ``case``'s shapes and dtype, ``(B, H, S, D)`` (zero arrays: only the
    shapes matter)."""
    dtype = fastattn._arrays.numpy_dtype(case.dtype)
    q = np.zeros((case.batch, case.heads_q, case.seq_q, case.head_dim), dtype)
    k = np.zeros((case.batch, case.heads_kv, case.seq_k, case.head_dim), dtype)
    v = np.zeros((case.batch, case.heads_kv, case.seq_k, case.head_dim_v), dtype)
    return fastattn.explain(q, k, v).problem


AMX_TILE_CASES = {
    "plain": {},
    "causal-gqa-bool-mask": {"causal": "bottom_right", "mask_kind": "bool", "mask_shape": (2, 1, 1, 600)},
    "window-float-mask-softcap": {"window": (150, 20), "mask_kind": "float", "mask_shape": (300, 600), "softcap": 8.0},
    "key-lengths-value-dim-48": {"key_lengths": (600, 77), "head_dim_v": 48, "causal": True},
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("options", list(AMX_TILE_CASES.values()), ids=list(AMX_TILE_CASES))
def test_half_precision_large_tiles_match_oracle(options, dtype) -> None:
    """bfloat16 and float16 with enough work items for the AMX kernel's large tiles (AMX_TILE_ROWS
    query rows, AMX_KEY_TILE keys, 600 keys ending on a partial tile) on the amx level, V packed once
    for the query blocks (float16: K and V split into bfloat16 parts once; windows then start on a
    tile boundary); the vector kernels elsewhere."""
    case = _bfloat16_case(options, dtype=dtype)
    if isa.active() == "amx":  # 20 items of 64 positions: four for each of up to 5 threads
        problem = _problem_of(case)
        assert cpu_backend.tile_sizes(problem, 2) == (cpu_backend.AMX_TILE_ROWS, cpu_backend.AMX_KEY_TILE)
        assert cpu_backend.forward_plan(problem, 2).packs_kv, "five query blocks share each packed V tile"
    before = fastattn.get_num_threads()
    fastattn.set_num_threads(2)
    try:
        check_forward("cpu", "cpu", case)
    finally:
        fastattn.set_num_threads(before)


#: float16/bfloat16 prefills whose K and V the vector kernels convert once per call: a partial last
#: tile, keys past key_lengths (left unconverted), a window with a float mask, bshd strided views.
CONVERTED_KV_CASES = {
    "plain-partial-tile": {},
    "causal-key-lengths": {"causal": True, "key_lengths": (600, 77)},
    "window-float-mask-dv-48-bshd-strided": {"window": (150, 20), "mask_kind": "float", "mask_shape": (300, 600),
                                             "head_dim_v": 48, "layout": "bshd", "strided": "strided"},
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("options", list(CONVERTED_KV_CASES.values()), ids=list(CONVERTED_KV_CASES))
def test_half_precision_keys_and_values_converted_once_match_oracle(options, dtype, threads) -> None:
    """float16/bfloat16 prefills (2 kv heads of group 2, 300 positions: ten query blocks a head) on
    the vector kernels convert K and V to float32 once per call, before the items
    (``converts_kv_once`` in fastattn/_cpu/forward_items.h): every level but amx, and at the
    avx512bf16 level float16 only (bfloat16 runs on ``vdpbf16ps`` there).  At the amx level the pass
    packs bfloat16 V^T, or splits float16 K and V into bfloat16 parts (flash_amx.h), for the AMX items."""
    case = _bfloat16_case(options, dtype=dtype)
    plan = cpu_backend.forward_plan(_problem_of(case), 2)
    if isa.active() in ("avx2", "generic", "avx512", "amx") or (isa.active() == "avx512bf16" and dtype == "float16"):
        assert plan.packs_kv, "ten query blocks share each converted K/V tile"
    fastattn.set_num_threads(2)
    check_forward("cpu", "cpu", case)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_garbage_past_key_lengths_stays_out_of_keys_converted_once(dtype: str) -> None:
    """NaN and infinity past a batch row's key_lengths (the pass leaves those keys unconverted, and no
    item reads them) reach no output: a float16/bfloat16 prefill of 7 query blocks a kv head."""
    rng = np.random.default_rng()
    element = fastattn._arrays.numpy_dtype(dtype)
    shapes = ((2, 4, 100, 64), (2, 2, 300, 64), (2, 2, 300, 40))
    q, k, v = (rng.standard_normal(shape).astype(element) for shape in shapes)
    key_lengths = np.array([300, 77])
    k[1, :, 77:], v[1, :, 77:] = np.nan, np.inf
    out = fastattn.attention(q, k, v, key_lengths=key_lengths, backend="cpu")
    clean_k, clean_v = k.astype(np.float64), v.astype(np.float64)
    clean_k[1, :, 77:], clean_v[1, :, 77:] = 0.0, 0.0
    expected = fastattn.attention(q.astype(np.float64), clean_k, clean_v, key_lengths=key_lengths, backend="reference")
    assert np.isfinite(out.astype(np.float64)).all()
    assert relative_error(out.astype(np.float64), expected) <= FORWARD_TOLERANCE[dtype]


PAIRS_FORWARD_CASES = {
    "plain-odd-keys": {"seq_k": 601},
    "causal-gqa-bool-mask": {"causal": "bottom_right", "mask_kind": "bool", "mask_shape": (2, 1, 1, 601)},
    "window-float-mask-softcap": {"window": (150, 20), "mask_kind": "float", "mask_shape": (300, 601), "softcap": 8.0},
    "key-lengths-value-dim-96": {"key_lengths": (601, 77), "head_dim_v": 96, "causal": True},
    "sixteen-row-tile-bshd-strided": {"seq_q": 5, "layout": "bshd", "strided": "strided", "head_dim": 128},
}


@pytest.mark.parametrize("options", list(PAIRS_FORWARD_CASES.values()), ids=list(PAIRS_FORWARD_CASES))
def test_bfloat16_forward_on_the_dot_product_units_matches_oracle(options, threads) -> None:
    """bfloat16 forward items (GQA group 2, 601 keys: an odd last key tile, whose last key pair
    holds one key) on the kernel the level runs them on: `vdpbf16ps` vectors on the avx512bf16 level
    (one 16-row tile for 5 positions), AMX tiles on the amx level, float32 vectors below."""
    case = _bfloat16_case(options, seq_k=601)
    problem = _problem_of(case)
    block_queries = cpu_backend.plan(problem, 2)[0]
    kernel = _flash.forward_kernel(problem, block_queries, cpu_backend.tile_sizes(problem, 2)[1])
    assert kernel == {"avx512bf16": "dpbf16", "amx": _amx_kernel_of(case, block_queries)}.get(isa.active(), "vector")
    fastattn.set_num_threads(2)
    check_forward("cpu", "cpu", case)


#: bfloat16 items of at most this many rows run on the AMX decode kernel at the amx level (where D
#: and Dv are multiples of 32; fastattn/_cpu/flash_amx.h: kAmxDecodeMaxRows).
AMX_DECODE_MAX_ROWS = 16


def _amx_kernel_of(case: Case, block_queries: int) -> str:
    """The amx level's kernel for ``case``'s bfloat16 items of ``block_queries`` positions."""
    rows = case.group * min(block_queries, case.seq_q)
    dims_fit = case.head_dim % 32 == 0 and case.head_dim_v % 32 == 0
    return "amx-decode" if rows <= AMX_DECODE_MAX_ROWS and dims_fit else "amx"


#: float16 forward cases: the bfloat16 ones (the last of 10 rows an item: on the float32 vectors at
#: every level), and a kv head of one query block of 64 rows over 1100 keys (its items split their
#: key tiles themselves on AMX: no pass before them).
FLOAT16_FORWARD_CASES = {
    **PAIRS_FORWARD_CASES,
    "one-query-block-split-per-tile": {"seq_q": 16, "group": 4, "seq_k": 1100, "key_lengths": (1100, 390)},
}

#: float16 items of at most this many rows stay on the float32 vectors at the amx level
#: (fastattn/_cpu/flash_amx.h: kHalfAmxMinRows).
HALF_AMX_MIN_ROWS = 32


@pytest.mark.parametrize("options", list(FLOAT16_FORWARD_CASES.values()), ids=list(FLOAT16_FORWARD_CASES))
def test_float16_forward_keeps_float32_accuracy(options, threads) -> None:
    """float16 forward items of more than HALF_AMX_MIN_ROWS rows on the amx level run on AMX tiles as
    three products of bfloat16 parts (fastattn/_cpu/flash_bf16.h: split_floats; K and V split by a
    pass before the items where a kv head has several query blocks, else per key tile by the item),
    float32 vectors elsewhere: either way within twice the error of the float32 kernels' output
    rounded to float16 (a float16 -> bfloat16 rounding of the inputs or of P would be ~8x that), and
    within the conformance tolerance of the oracle."""
    case = _bfloat16_case(options, seq_k=601, dtype="float16")
    problem = _problem_of(case)
    block_queries, key_tile = cpu_backend.plan(problem, 2)[0], cpu_backend.tile_sizes(problem, 2)[1]
    on_amx = isa.active() == "amx" and case.group * min(block_queries, case.seq_q) > HALF_AMX_MIN_ROWS
    assert _flash.forward_kernel(problem, block_queries, key_tile) == ("amx" if on_amx else "vector")
    if on_amx:
        several_blocks = case.seq_q > block_queries
        assert cpu_backend.forward_plan(problem, 2).packs_kv == several_blocks
    fastattn.set_num_threads(2)
    check_forward("cpu", "cpu", case)
    inputs = make_inputs(case)
    options = case.kwargs(inputs)
    out = fastattn.attention(inputs["q"], inputs["k"], inputs["v"], backend="cpu", **options)
    out32 = fastattn.attention(*(inputs[name].astype(np.float32) for name in "qkv"), backend="cpu", **options)
    expected, _ = _oracle.forward(*(bhsd_float64(inputs[name], case.layout) for name in "qkv"),
                                  case.oracle_options(inputs))
    error = relative_error(bhsd_float64(out, case.layout), expected)
    error32 = relative_error(bhsd_float64(out32.astype(np.float16), case.layout), expected)
    assert error <= 2 * error32, f"float16 {error:.3g} against float32 rounded to float16 {error32:.3g}"


#: How far the scores of each run of keys rise along a shared direction, per unit of a row's weight,
#: and how many keys each run has (runs start at multiples of 256: whole key tiles of up to 256 keys,
#: so a tile's rise is its own).  At weight 1 (scale 1/8) the running maximum grows by 200 bits of
#: 2^t (P infinite against the maximum as it stood), by 4 (a settled tile whose P exceeds 1), by 121,
#: and falls.  After 121 bits each tile's P and its sum are finite (~2^126.5 for 128 keys) but the
#: sum of 1024 keys' P is not: only the sum's limit keeps those tiles out of the row sum (an infinite
#: row sum gives a zero output and an infinite lse, which the rerun on non-finite outputs misses).
RISING_SCORE_STEPS = ((0.0, 256), (1109.0, 256), (1131.0, 256), (1783.0, 1024), (1200.0, 256))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_half_precision_softmax_follows_a_rising_maximum(dtype, causal, threads) -> None:
    """The half-precision forwards' softmax runs a tile whose rows' maxima have settled against the
    maximum as it stands, and runs it again with the maximum's pass where a row's sum of that tile's
    P reaches 2^16 (forward_tiles.h: settled_softmax_step).  Here each run of keys' scores lie
    RISING_SCORE_STEPS times a row weight of 0.02, 0.3 or 1 (drawn per row: some rows of a row vector
    settle, some do not) above the first run's: every row against the float64 oracle, and the lse
    within 1e-2 (float16's products drop the lo x lo parts: here its lse errs by ~5e-4)."""
    rng = np.random.default_rng()
    rises, lengths = zip(*RISING_SCORE_STEPS)
    batch, heads_q, heads_kv, seq_q, seq_k, dims = 1, 4, 2, 96, sum(lengths), 64
    direction = rng.standard_normal(dims)
    direction /= np.linalg.norm(direction)
    weight = rng.choice([0.02, 0.3, 1.0], size=(batch, heads_q, seq_q, 1))
    rise = np.repeat(rises, lengths)[:, None]
    q = rng.standard_normal((batch, heads_q, seq_q, dims))
    q += (weight - q @ direction[:, None]) * direction  # q . direction = weight, before rounding
    k = rng.standard_normal((batch, heads_kv, seq_k, dims)) + rise * direction
    v = rng.standard_normal((batch, heads_kv, seq_k, dims))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    fastattn.set_num_threads(2)
    out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True, backend="cpu")
    expected, expected_lse = _oracle.forward(*(x.astype(np.float64) for x in (q, k, v)), _oracle.Options(causal=causal))
    difference = np.linalg.norm(out.astype(np.float64) - expected, axis=-1)
    row_error = difference / np.linalg.norm(expected, axis=-1)
    assert row_error.max() <= FORWARD_TOLERANCE[np.dtype(dtype).name], f"worst row {row_error.max():.3g}"
    np.testing.assert_allclose(lse, expected_lse, rtol=0, atol=1e-2)  # 1% of the row sum, as the output


DOT_DECODE_CASES = {
    "one-row-split-keys": {"batch": 1, "heads_kv": 1, "seq_q": 1},
    "gqa-bool-mask-lengths": {"seq_q": 2, "mask_kind": "bool", "mask_shape": (2, 1, 1, 600), "key_lengths": (600, 77)},
    "causal-window-float-mask-softcap": {
        "seq_q": 2, "causal": "bottom_right", "window": (250, 0), "mask_kind": "float", "mask_shape": (2, 600),
        "softcap": 8.0,
    },
    "value-dim-32-bshd-strided": {"seq_q": 1, "head_dim_v": 32, "layout": "bshd", "strided": "strided"},
    "one-row-dims-128": {"group": 1, "seq_q": 1, "head_dim": 128, "head_dim_v": 128, "key_lengths": (600, 301)},
    "two-rows-value-dim-160": {"group": 2, "seq_q": 1, "head_dim": 96, "head_dim_v": 160, "causal": "bottom_right"},
    "three-rows-value-dim-96": {"group": 3, "seq_q": 1, "head_dim_v": 96, "key_lengths": (599, 33)},
    "five-rows-bool-mask": {"group": 5, "seq_q": 1, "mask_kind": "bool", "mask_shape": (2, 10, 1, 600)},
    "seven-rows-softcap": {"group": 7, "seq_q": 1, "head_dim": 128, "softcap": 5.0},
}


@pytest.mark.parametrize("options", list(DOT_DECODE_CASES.values()), ids=list(DOT_DECODE_CASES))
def test_bfloat16_decode_on_the_dot_product_units_matches_oracle(options) -> None:
    """bfloat16 decode (at most kDotMaxRows stacked rows: 1-8, group 4 x 1-2 queries by default) over
    600 keys, whose last key tile is partial, on the AMX decode kernel or the `vdpbf16ps` one where
    the level has them, the float32 vector one elsewhere; the first case's single (b, kv head) item
    splits its keys across threads.  The row counts take every row grouping of the `vdpbf16ps`
    scores (4, 2, 1) and every O width (Dv 32-160: whole blocks and a 32-column rest)."""
    case = _bfloat16_case(options, group=4, seq_q=1)
    problem = _problem_of(case)
    kernel = _flash.forward_kernel(problem, case.seq_q, cpu_backend.AMX_KEY_TILE)
    assert kernel == {"avx512bf16": "dpbf16-decode", "amx": "amx-decode"}.get(isa.active(), "vector-decode")
    _check_decode_on_two_threads(case, problem)


def _check_decode_on_two_threads(case: Case, problem) -> None:
    """check_forward of ``case`` on 2 threads; a single (b, kv head) item must split its keys."""
    before = fastattn.get_num_threads()
    fastattn.set_num_threads(2)
    try:
        if case.batch * case.heads_kv == 1:
            assert cpu_backend.plan(problem, 2)[1] > 1, "expected the keys split across threads"
        check_forward("cpu", "cpu", case)
    finally:
        fastattn.set_num_threads(before)


#: bfloat16 decodes of 9-16 stacked rows (AMX_DECODE_MAX_ROWS): on the AMX decode kernel, whose
#: even and odd parity rows then take a P tile each (two chunks of O's columns a pass: Dv 32, 96 and
#: 160 leave one chunk over); on the row-block kernels at the other levels.
WIDE_DECODE_CASES = {
    "nine-rows-one-item-split-keys": {"batch": 1, "heads_kv": 1, "group": 9, "seq_q": 1},
    "ten-rows-value-dim-32-float-mask-softcap": {
        "group": 5, "seq_q": 2, "head_dim_v": 32, "mask_kind": "float", "mask_shape": (2, 600), "softcap": 8.0,
    },
    "twelve-rows-value-dim-96-causal-window": {
        "group": 4, "seq_q": 3, "head_dim_v": 96, "causal": "bottom_right", "window": (250, 0),
    },
    "sixteen-rows-bool-mask-lengths": {
        "group": 8, "seq_q": 2, "mask_kind": "bool", "mask_shape": (2, 1, 1, 600), "key_lengths": (600, 77),
    },
    "sixteen-rows-value-dim-160-bshd-strided": {
        "group": 16, "seq_q": 1, "head_dim": 128, "head_dim_v": 160, "layout": "bshd", "strided": "strided",
    },
}


@pytest.mark.parametrize("options", list(WIDE_DECODE_CASES.values()), ids=list(WIDE_DECODE_CASES))
def test_bfloat16_decode_of_nine_to_sixteen_rows_matches_oracle(options) -> None:
    """bfloat16 decodes of 9-16 stacked rows over 600 keys (a partial last key tile) on the kernel the
    level runs them on; the first case's single item splits its keys across threads."""
    case = _bfloat16_case(options)
    problem = _problem_of(case)
    block_queries, _ = cpu_backend.plan(problem, 2)
    kernel = _flash.forward_kernel(problem, block_queries, cpu_backend.tile_sizes(problem, 2)[1])
    assert kernel == {"avx512bf16": "dpbf16", "amx": "amx-decode"}.get(isa.active(), "vector")
    _check_decode_on_two_threads(case, problem)


@pytest.mark.parametrize("group", [4, 12])
def test_bfloat16_decode_keeps_the_references_nan_and_inf_columns(group: int) -> None:
    """A NaN and an infinity in V at visible keys (one column each) give the reference's NaN/inf pattern
    and its finite values elsewhere: the AMX decode's parity pairs also multiply each value's
    neighbour column by 0 (NaN there), which the rerun that skips zero weights must undo."""
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 2 * group, 1, 64)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((2, 2, 300, 64)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((2, 2, 300, 64)).astype(ml_dtypes.bfloat16)
    v[0, 1, 17, 5] = np.nan
    v[1, 0, 250, 10] = np.inf
    out = fastattn.attention(q, k, v, backend="cpu")
    with np.errstate(invalid="ignore"):
        expected = fastattn.attention(*(x.astype(np.float64) for x in (q, k, v)), backend="reference")
    got = out.astype(np.float64)
    for test in (np.isnan, np.isposinf, np.isneginf):
        assert np.array_equal(test(got), test(expected)), f"{test.__name__} pattern differs from the reference"
    assert np.isnan(expected[0, group:, :, 5]).all() and np.isposinf(expected[1, :group, :, 10]).all()
    finite = np.isfinite(expected)
    assert relative_error(got[finite], expected[finite]) <= FORWARD_TOLERANCE["bfloat16"]


@pytest.mark.parametrize("seq_q", [1, 77])
def test_bfloat16_dropout_drops_the_references_elements(seq_q: int) -> None:
    """Dropout in the bfloat16 decode (1 position) and forward (77: AMX or `vdpbf16ps` where the level
    has them): the reference's mask, kept elements within bfloat16 rounding."""
    rng = np.random.default_rng()
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((2, 8, seq_q, 64)).astype(bf16)
    k = rng.standard_normal((2, 2, 300, 64)).astype(bf16)
    v = rng.standard_normal((2, 2, 300, 64)).astype(bf16)
    drop = {"dropout_p": 0.3, "dropout_seed": int(rng.integers(2**63)), "causal": "bottom_right"}
    out = fastattn.attention(q, k, v, backend="cpu", **drop)
    want = fastattn.attention(*(x.astype(np.float64) for x in (q, k, v)), backend="reference", **drop)
    error = relative_error(out.astype(np.float64), want.astype(bf16).astype(np.float64))
    assert error <= FORWARD_TOLERANCE["bfloat16"], f"{error:.3g}"


@pytest.mark.parametrize(
    ("dtype", "head_dim", "head_dim_v", "expected"),
    [("bfloat16", 64, 64, True), ("bfloat16", 48, 64, False), ("bfloat16", 64, 40, False), ("float16", 64, 64, True),
     ("float16", 64, 40, False), ("float32", 64, 64, False)],
)
def test_planner_picks_amx_tiles_by_the_kernels_rule(
    dtype: str, head_dim: int, head_dim_v: int, expected: bool
) -> None:
    """The planner asks the kernels (``_flash.forward_kernel``) rather than restating their rule."""
    numpy_dtype = fastattn._arrays.numpy_dtype(dtype)
    q = np.zeros((2, 4, 300, head_dim), numpy_dtype)
    k = np.zeros((2, 2, 600, head_dim), numpy_dtype)
    v = np.zeros((2, 2, 600, head_dim_v), numpy_dtype)
    problem = fastattn.explain(q, k, v).problem
    amx_tiles = (cpu_backend.AMX_TILE_ROWS, cpu_backend.AMX_KEY_TILE)
    assert (cpu_backend.tile_sizes(problem, 2) == amx_tiles) == (expected and isa.active() == "amx")


AMX_BACKWARD_CASES = {
    "plain": {},
    "causal-bool-mask-lengths": {"causal": "bottom_right", "mask": "bool", "key_lengths": True},
    "window-float-mask-softcap": {"window": (90, 7), "mask": "float", "softcap": 6.0},
    "dropout-value-dim-96": {"dropout_p": 0.3, "head_dim_v": 96, "causal": True},
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", sorted(AMX_BACKWARD_CASES))
def test_half_precision_backward_on_the_dot_product_units_matches_reference(case: str, dtype: str) -> None:
    """bfloat16 and float16 gradients of GQA heads over 300 keys on the AMX gradient pass (key blocks
    of AMX_KEY_TILE, the last of 44 keys: partial 16- and 32-key steps; float16 as bfloat16 parts) or,
    for bfloat16, the `vdpbf16ps` one (blocks of KEY_TILE; with key_lengths a last block of 13 live
    keys, an odd pair) where the level has them, else the float32 vector kernels: within the
    conformance suite's tolerance of the float64 reference, and bit-identical on one and two
    threads.  float16's gradients keep float32's accuracy: within twice the error of the float32
    kernels' gradients rounded to float16 (P and dS rounded to bfloat16 would be several times it)."""
    features = dict(AMX_BACKWARD_CASES[case])
    head_dim_v = features.pop("head_dim_v", 64)
    rng = np.random.default_rng()
    half = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    q = rng.standard_normal((2, 4, 77, 64)).astype(half)
    k = rng.standard_normal((2, 2, 300, 64)).astype(half)
    v = rng.standard_normal((2, 2, 300, head_dim_v)).astype(half)
    dout = rng.standard_normal((2, 4, 77, head_dim_v)).astype(half)
    call: dict = {key: value for key, value in features.items() if key in ("causal", "window", "softcap", "dropout_p")}
    if features.get("mask") == "bool":
        call["mask"] = rng.random((2, 1, 77, 300)) < 0.9
    if features.get("mask") == "float":
        call["mask"] = rng.standard_normal((77, 300)).astype(np.float32)
    if features.get("key_lengths"):
        call["key_lengths"] = np.array([300, 141])
    if "dropout_p" in call:
        call["dropout_seed"] = int(rng.integers(2**63))
    problem = fastattn.explain(q, k, v, **call).problem
    on_amx = isa.active() == "amx"
    kernels = {"avx512bf16": "dpbf16", "amx": "amx"} if dtype == "bfloat16" else {"amx": "amx"}
    assert cpu_backend.backward_plan(problem, 2).kernel == kernels.get(isa.active(), "vector")
    amx_tiles = (cpu_backend.AMX_TILE_ROWS, cpu_backend.AMX_KEY_TILE)
    assert (cpu_backend.backward_tile_sizes(problem) == amx_tiles) == on_amx
    out, lse = fastattn.attention(q, k, v, return_lse=True, backend="reference", **call)
    before = fastattn.get_num_threads()
    grads = {}
    try:
        for threads in (1, 2):
            fastattn.set_num_threads(threads)
            grads[threads] = fastattn.attention_backward(dout, q, k, v, out, lse, backend="cpu", **call)
        widened = [x.astype(np.float32) for x in (dout, q, k, v, out)]
        grads32 = fastattn.attention_backward(*widened, lse, backend="cpu", **call)
    finally:
        fastattn.set_num_threads(before)
    wide = [x.astype(np.float64) for x in (dout, q, k, v)]
    out64, lse64 = fastattn.attention(*wide[1:], return_lse=True, backend="reference", **call)
    expected = fastattn.attention_backward(*wide, out64, lse64, backend="reference", **call)
    for name, one, two, exact, single in zip("qkv", grads[1], grads[2], expected, grads32):
        assert np.array_equal(one, two, equal_nan=True), f"d{name} differs between one and two threads"
        error = relative_error(two.astype(np.float64), exact.astype(half).astype(np.float64))
        assert error <= BACKWARD_TOLERANCE[dtype], f"d{name}: {error:.3g}"
        if dtype == "float16":
            error = relative_error(two.astype(np.float64), exact)
            error32 = relative_error(single.astype(np.float16).astype(np.float64), exact)
            assert error <= 2 * error32, f"d{name}: float16 {error:.3g}, float32 rounded to float16 {error32:.3g}"
    if "key_lengths" in call:
        assert np.all(grads[2][1][1, :, 141:] == 0) and np.all(grads[2][2][1, :, 141:] == 0)


BACKWARD_CHUNK_CASES = {
    "causal-window-float32": ({"causal": "bottom_right", "window": (50, 3)}, np.float32, 2),
    "mask-lengths-float32": ({"mask": "bool", "key_lengths": True}, np.float32, 2),
    "softcap-gqa-float16": ({"softcap": 5.0}, np.float16, 1),
}


@pytest.mark.parametrize("case", sorted(BACKWARD_CHUNK_CASES))
def test_backward_sums_the_dq_partials_of_several_key_chunks(case: str) -> None:
    """Keys 300 = three key blocks, each its own chunk with its own dQ partial, summed in pass 3."""
    features, dtype, heads_kv = BACKWARD_CHUNK_CASES[case]
    rng = np.random.default_rng()
    q, dout = (rng.standard_normal((2, 4, 70, 40)) for _ in range(2))
    k, v = rng.standard_normal((2, heads_kv, 300, 40)), rng.standard_normal((2, heads_kv, 300, 24))
    dout = dout[..., :24]
    call: dict = {key: value for key, value in features.items() if key in ("causal", "window", "softcap")}
    if features.get("mask") == "bool":
        call["mask"] = rng.random((2, 1, 70, 300)) < 0.8
    if features.get("key_lengths"):
        call["key_lengths"] = np.array([300, 211])
    options = _oracle.Options(**call)
    problem = fastattn.explain(q.astype(dtype), k.astype(dtype), v.astype(dtype), **call).problem
    assert cpu_backend.backward_chunks(problem) == 3
    inputs = [x.astype(dtype) for x in (q, k, v, dout)]
    out, lse = fastattn.attention(*inputs[:3], return_lse=True, backend="cpu", **call)
    grads = fastattn.attention_backward(inputs[3], *inputs[:3], out, lse, backend="cpu", **call)
    expected = _oracle.backward(*(x.astype(dtype).astype(np.float64) for x in (dout, q, k, v)), options)
    tolerance = 1e-4 if dtype == np.float32 else 1e-2
    for name, grad, exact, size in zip("qkv", grads, expected[:3], expected.magnitudes):
        error = np.abs(grad.astype(np.float64) - exact)
        assert np.all(error <= tolerance * (0.1 + size)), f"d{name}: worst error {error.max():.3g}"


def test_backward_chunks_come_from_the_problem_and_bound_the_partials() -> None:
    def problem(batch, heads_kv, seq_q, seq_k, group=4):
        return SimpleNamespace(batch=batch, heads_q=group * heads_kv, heads_kv=heads_kv, seq_q=seq_q, seq_k=seq_k,
                               head_dim=128, dtype="float32")

    items = cpu_backend.BACKWARD_ITEMS
    assert cpu_backend.backward_chunks(problem(1, 1, 64, 100)) == 1  # one key block
    assert cpu_backend.backward_chunks(problem(1, 2, 4096, 4096)) == min(32, items // 2)
    assert cpu_backend.backward_chunks(problem(items, 1, 4096, 4096)) == 1  # enough (batch, kv head) items
    # bench_cpu.py --memory's case: dQ of 128 MiB, so two chunks' partials fill the 256 MiB
    assert cpu_backend.backward_chunks(problem(1, 8, 32768, 32768, group=1)) == 2
    assert cpu_backend.backward_chunks(problem(1, 8, 32768, 32768, group=4)) == 1  # dQ alone is 512 MiB
    assert cpu_backend.backward_chunks(problem(1, 1, 0, 0)) == 1


_MEMORY_PROBE = r"""
import json, sys
import numpy as np
import fastattn
from fastattn._bench import peak_rss_kib
heads, seq, dim = 8, 8192, 64
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, heads, seq, dim), dtype=np.float32) for _ in range(3))
small = fastattn.attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], causal=True, backend="cpu")
before = peak_rss_kib()
out = fastattn.attention(q, k, v, causal=True, backend="cpu")
after = peak_rss_kib()
print(json.dumps({"extra_kib": after - before, "out_kib": out.nbytes // 1024}))
"""


def test_forward_memory_is_independent_of_seq_q_times_seq_k() -> None:
    """An 8-head 8192x8192 causal forward: scores would need 2 GiB; extra memory stays < 64 MiB."""
    result = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    extra_mib = (measured["extra_kib"] - measured["out_kib"]) / 1024
    assert extra_mib > -1, f"the peak RSS grew {measured['extra_kib']} KiB, less than the output: not measured"
    assert extra_mib < 64, f"{extra_mib:.1f} MiB beyond the output"

