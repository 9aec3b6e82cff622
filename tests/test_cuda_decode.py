"""The split-KV decode kernel on a CUDA device (issue #13); skipped without CuPy and a device.

Every case asserts that the decode kernel is what ran, then compares against the float64 oracle
with the conformance suite's checks (poisoned outputs, -inf lse and zero output exactly on rows
that see no key, FORWARD_TOLERANCE: float32 1e-5): cache lengths 1 to 4097 (odd, tile edges),
per-row key_lengths including 0, GQA groups, Sq up to 16, both causal alignments, windows, masks,
softcap, forced split counts; and half precision within twice torch's own error.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import fastattn
from fastattn import _arrays
from fastattn._gpu import decode

from ._decode_cases import (
    FEATURES,
    NONFINITE_CASES,
    RISING_CASES,
    assert_decode_matches_the_reference,
    decode_case,
    nonfinite_inputs,
    ragged,
    rising_inputs,
)
from ._poison import poisoned_allocator
from .conformance._cases import Case, bhsd_float64, relative_error
from .conformance.test_forward import check_forward

cupy = pytest.importorskip("cupy")
if not fastattn.backends.available()["cuda"].available:
    pytest.skip(f"cuda backend unavailable: {fastattn.backends.available()['cuda']!r}", allow_module_level=True)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Results allocated NaN-filled, so an element the kernels never write fails the comparison."""
    monkeypatch.setattr(_arrays, "empty_bhsd", poisoned_allocator())


@pytest.fixture
def decode_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records ``decode.plan``'s (splits, keys_per_split) of every decode launch."""
    calls: list[tuple[int, int]] = []
    planned = decode.plan

    def recording(problem, multiprocessors):
        calls.append(planned(problem, multiprocessors))
        return calls[-1]

    monkeypatch.setattr(decode, "plan", recording)
    return calls


def check_decode(case: Case, calls: list[tuple[int, int]]) -> None:
    calls.clear()
    check_forward("cuda", "cuda", case)
    assert calls, "the decode kernel did not run"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("seq_k", [1, 7, 63, 64, 65, 1001, 4096, 4097])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("lengths", [False, True])
def test_cache_lengths(dtype, seq_k, group, lengths, decode_calls) -> None:
    case = decode_case(dtype=dtype, seq_k=seq_k, group=group, key_lengths=ragged(seq_k) if lengths else None)
    check_decode(case, decode_calls)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seq_q", [2, 5, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", ["bottom_right", "top_left", False])
def test_query_rows_and_alignments(dtype, seq_q, group, causal, decode_calls) -> None:
    """Packs of 2 to 128 rows (chunked past 8 in float32, past 16 on tensor cores), every alignment;
    top-left leaves most splits empty."""
    case = decode_case(dtype=dtype, seq_q=seq_q, seq_k=777, group=group, causal=causal, key_lengths=ragged(777))
    check_decode(case, decode_calls)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dim", decode.HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_features(feature, head_dim, dtype, decode_calls) -> None:
    case = decode_case(dtype=dtype, seq_k=500, head_dim=head_dim, head_dim_v=head_dim, key_lengths=ragged(500))
    check_decode(dataclasses.replace(case, **FEATURES[feature]), decode_calls)


@pytest.mark.parametrize("splits", [1, 2, 7, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forced_split_counts(splits, dtype, monkeypatch) -> None:
    """Any split count merges to the same result; splits past a row's length only write -inf."""
    seq_k = 4096
    per_split = math.ceil(math.ceil(seq_k / splits) / 64) * 64
    calls = []
    monkeypatch.setattr(decode, "plan", lambda problem, multiprocessors: calls.append(1) or (splits, per_split))
    check_forward("cuda", "cuda", decode_case(dtype=dtype, seq_k=seq_k, key_lengths=(4096, 1000, 0)))
    assert calls


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_half_precision_error_no_worse_than_twice_torch(dtype, head_dim, decode_calls) -> None:
    """G7-like decode with ragged lengths: against float64, at most 2x torch SDPA's error."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    generator = torch.Generator(device="cuda").manual_seed(7)
    batch, heads_q, heads_kv, seq_k = 4, 32, 8, 4096
    shape_q, shape_kv = (batch, heads_q, 1, head_dim), (batch, heads_kv, seq_k, head_dim)
    low = getattr(torch, dtype)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.float64, generator=generator).to(low)
        for shape in (shape_q, shape_kv, shape_kv)
    )
    lengths = torch.tensor([4096, 4001, 17, 1], device="cuda")
    exact = fastattn.attention(q.double(), k.double(), v.double(), key_lengths=lengths, causal="bottom_right",
                               backend="reference")  # fmt: skip
    ours = fastattn.attention(q, k, v, key_lengths=lengths, causal="bottom_right", backend="cuda")
    assert decode_calls
    visible = (torch.arange(seq_k, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    exact_host = exact.cpu().numpy()
    error = relative_error(ours.double().cpu().numpy(), exact_host)
    assert error <= 2 * relative_error(theirs.double().cpu().numpy(), exact_host)


def test_lse_is_natural_log_and_matches_float64(decode_calls) -> None:
    rng = np.random.default_rng(5)
    q = cupy.asarray(rng.standard_normal((3, 8, 1, 128)).astype(np.float32))
    k = cupy.asarray(rng.standard_normal((3, 2, 4097, 128)).astype(np.float32))
    v = cupy.asarray(rng.standard_normal((3, 2, 4097, 128)).astype(np.float32))
    lengths = cupy.asarray(ragged(4097))
    out, lse = fastattn.attention(q, k, v, key_lengths=lengths, causal="bottom_right", return_lse=True)
    assert decode_calls
    want_out, want_lse = fastattn.attention(
        q.astype(cupy.float64), k.astype(cupy.float64), v.astype(cupy.float64), key_lengths=lengths,
        causal="bottom_right", return_lse=True, backend="reference",
    )  # fmt: skip
    empty = np.isneginf(want_lse.get())
    assert np.array_equal(np.isneginf(lse.get()), empty)
    assert relative_error(lse.get()[~empty].astype(np.float64), want_lse.get()[~empty]) <= 1e-5
    assert relative_error(bhsd_float64(out, "bhsd"), want_out.get()) <= 1e-5


@pytest.mark.parametrize("case", [entry[1] for entry in NONFINITE_CASES], ids=[entry[0] for entry in NONFINITE_CASES])
def test_nan_and_inf_in_the_cache_follow_the_reference(case: Case, decode_calls) -> None:
    """The exact paths on the device: the float32 decode's redo, the tensor-core decode's rerun."""
    assert_decode_matches_the_reference("cuda", "cuda", case, nonfinite_inputs(case))
    assert decode_calls, "the decode kernel did not run"


@pytest.mark.parametrize("case", [entry[1] for entry in RISING_CASES], ids=[entry[0] for entry in RISING_CASES])
def test_row_maxima_rising_far_past_the_first_tile(case: Case, decode_calls) -> None:
    assert_decode_matches_the_reference("cuda", "cuda", case, rising_inputs(case))
    assert decode_calls, "the decode kernel did not run"
