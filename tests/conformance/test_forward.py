"""Forward pass of every available backend against the float64 oracle."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn

from . import _oracle
from ._cases import FORWARD_TOLERANCE, Case, bhsd_float64, cases, make_inputs, relative_error, to_host

ALL_DTYPES = ("float64", "float32", "float16", "bfloat16")


def run_or_decline(backend: str, case: Case, inputs: dict) -> tuple | None:
    """Run the forward on ``backend``; None (after checking the refusal) when it declines."""
    explanation = fastattn.explain(inputs["q"], inputs["k"], inputs["v"], **case.kwargs(inputs))
    reasons = explanation.reasons[backend]
    if reasons:
        with pytest.raises(fastattn.UnsupportedError) as raised:
            fastattn.attention(inputs["q"], inputs["k"], inputs["v"], backend=backend, **case.kwargs(inputs))
        assert raised.value.reasons == reasons
        return None
    return fastattn.attention(
        inputs["q"], inputs["k"], inputs["v"], backend=backend, return_lse=True, **case.kwargs(inputs)
    )


def check_forward(backend: str, device: str, case: Case) -> None:
    inputs = make_inputs(case, device)
    before = {name: to_host(value) for name, value in inputs.items() if value is not None}
    result = run_or_decline(backend, case, inputs)
    for name, value in before.items():
        assert np.array_equal(to_host(inputs[name]), value, equal_nan=True), f"{name} was written to"
    if result is None:
        return
    out, lse = result
    assert out.dtype == inputs["q"].dtype
    assert lse.dtype == (np.float64 if case.dtype == "float64" else np.float32)
    expected_shape = (case.batch, case.heads_q, case.seq_q, case.head_dim_v)
    assert bhsd_float64(out, case.layout).shape == expected_shape
    assert lse.shape == expected_shape[:3]

    q, k, v = (bhsd_float64(inputs[name], case.layout) for name in "qkv")
    expected_out, expected_lse = _oracle.forward(q, k, v, case.oracle_options(inputs))
    got_out = bhsd_float64(out, case.layout)
    got_lse = to_host(lse).astype(np.float64)

    assert not np.isnan(got_out).any(), "NaN in out (an unwritten element or a 0/0)"
    empty_rows = np.isneginf(expected_lse)
    assert np.array_equal(np.isneginf(got_lse), empty_rows), "lse = -inf exactly on rows that see no key"
    assert np.all(got_out[empty_rows] == 0), "rows that see no key must be exactly 0"
    tolerance = FORWARD_TOLERANCE[case.dtype]
    assert relative_error(got_out, expected_out) <= tolerance
    # An error d in lse is a relative error d of the softmax denominator exp(lse): measure lse on
    # the scale max(|lse|, 1), not relative to an lse near 0 (the fuzz found lse = -0.0048, where
    # float32's m + log(l) cancels).
    seen = ~empty_rows
    scale = np.maximum(np.abs(expected_lse[seen]), 1.0)
    assert relative_error(got_lse[seen], expected_lse[seen], scale) <= tolerance


@settings(max_examples=500)
@given(case=cases())
def test_forward_matches_oracle(backend: str, device: str, case: Case) -> None:
    check_forward(backend, device, case)


@settings(max_examples=60)
@given(case=cases(dtypes=("float16", "bfloat16")))
def test_forward_half_precision_matches_oracle(backend: str, device: str, case: Case) -> None:
    check_forward(backend, device, case)


@st.composite
def _tile_shaped(draw, dtypes: tuple[str, ...]) -> Case:
    """A case the matrix-tile kernels take (the CPU's AMX bfloat16 forward): head dims of 32-row
    steps, value dims of 16 columns, more query rows than the decode path's 8."""
    case = draw(cases(dtypes=dtypes).filter(lambda case: case.group * case.seq_q > 8))
    return dataclasses.replace(
        case, head_dim=draw(st.sampled_from([32, 64, 128])), head_dim_v=draw(st.sampled_from([16, 48, 64, 128]))
    )


@settings(max_examples=40)
@given(case=_tile_shaped(dtypes=("bfloat16",)))
def test_forward_bfloat16_at_tile_shapes_matches_oracle(backend: str, device: str, case: Case) -> None:
    check_forward(backend, device, case)


@settings(max_examples=40)
@given(case=cases(), seq_k=st.integers(1, 600))
def test_decode_single_query(backend: str, device: str, case: Case, seq_k: int) -> None:
    """Sq = 1 against a long cache, bottom-right: the KV-cache step."""
    lengths = None if case.key_lengths is None else tuple(min(n, seq_k) for n in case.key_lengths)
    check_forward(
        backend,
        device,
        dataclasses.replace(
            case, seq_q=1, seq_k=seq_k, causal="bottom_right", mask_kind=None, mask_shape=None, key_lengths=lengths
        ),
    )


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("rows", range(1, 9))
def test_cpu_decode_every_row_count_matches_oracle(rows: int, dtype: str) -> None:
    """Sq = 1 with 1-8 stacked query rows (the GQA group) on the cpu decode: every row grouping of
    its score blocks (4, 2 and 1 rows a block), whole blocks of keys and the one-key-at-a-time rest
    (301 keys, lengths 301 and 77), O in whole vector blocks and a rest (Dv 80), at this level's
    vector width."""
    check_forward("cpu", "cpu", _stacked_decode(rows, dtype, head_dim=64, head_dim_v=80))


@pytest.mark.parametrize("head_dims", [(64, 64), (64, 80), (96, 68), (32, 128)])
@pytest.mark.parametrize("rows", range(1, 9))
def test_cpu_bfloat16_decode_in_and_out_of_pair_order_matches_oracle(rows: int, head_dims: tuple[int, int]) -> None:
    """The bfloat16 cpu decode reads K and V in pair order (2L elements a load, q and O reordered)
    where D and Dv are whole pair blocks at the level's width, else widens them as the other dtypes
    do: 64/64 and 32/128 are pair blocks at every level, 64/80 at avx2 and generic but not avx512,
    96/68 nowhere."""
    head_dim, head_dim_v = head_dims
    check_forward("cpu", "cpu", _stacked_decode(rows, "bfloat16", head_dim=head_dim, head_dim_v=head_dim_v))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("group", "seq_q"), [(4, 4), (8, 3), (16, 3)])
@pytest.mark.parametrize("head_dims", [(128, 80), (64, 128)])
def test_cpu_decode_of_several_positions_matches_oracle(
    group: int, seq_q: int, dtype: str, head_dims: tuple[int, int]
) -> None:
    """A decode of 3-4 positions with 16, 24 and 48 stacked rows a kv head (one query block): at
    the 32-register levels one row block keeps O by row and reads V rows where they lie (bfloat16
    in pair order where D and Dv are pair blocks: 64/128, not 128/80 at avx512), two row blocks
    convert half-precision V tiles for the transposed P.V."""
    head_dim, head_dim_v = head_dims
    check_forward("cpu", "cpu", _stacked_decode(group, dtype, head_dim=head_dim, head_dim_v=head_dim_v, seq_q=seq_q))


def _stacked_decode(rows: int, dtype: str, head_dim: int, head_dim_v: int, seq_q: int = 1) -> Case:
    """`seq_q` positions (1: Sq = 1) with `rows` query heads a kv head, 301 keys (lengths 301 and
    77), bottom-right causal, strided inputs."""
    return Case(
        batch=2, heads_kv=2, group=rows, seq_q=seq_q, seq_k=301, head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype,
        layout="bhsd", causal="bottom_right", window=None, mask_kind=None, mask_shape=None, key_lengths=(301, 77),
        softcap=None, scale=None, strided="strided", seed=int(np.random.default_rng().integers(2**32)),
    )


def test_fully_masked_rows_are_zero_with_minus_inf_lse(backend: str) -> None:
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 2, 6, 16))
    k = rng.standard_normal((1, 2, 4, 16))
    v = rng.standard_normal((1, 2, 4, 16))
    mask = np.ones((6, 4), dtype=bool)
    mask[2] = False
    out, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True, backend="reference")
    assert np.all(out[:, :, 2] == 0) and np.all(np.isneginf(lse[:, :, 2]))
    explanation = fastattn.explain(q, k, v, mask=mask)
    if explanation.reasons[backend]:
        pytest.skip(f"{backend} declines this problem: {explanation.reasons[backend]}")
    out_b, lse_b = fastattn.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
    assert np.all(out_b[:, :, 2] == 0) and np.all(np.isneginf(lse_b[:, :, 2]))
    assert relative_error(out_b, out) <= FORWARD_TOLERANCE["float64"]
