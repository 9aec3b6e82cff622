"""Every bad input of the public API: exception type, argument named first, caller's arrays untouched.

DESIGN.md §3: "Bad input gets a ValueError/TypeError that names the argument, what was expected and
what was received, before any kernel runs; an explicitly requested backend that cannot run the
problem raises fastattn.UnsupportedError listing its reasons. Nothing is written into the caller's
arrays."  Messages start with the argument's name followed by a colon ("window: expected ...").
"""

from __future__ import annotations

import importlib.util
import math
import zlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import fastattn

B, HQ, HKV, SQ, SK, D, DV = 2, 4, 2, 5, 6, 8, 3
LAYOUTS = ("bhsd", "bshd")
BF16 = np.dtype(ml_dtypes.bfloat16)
HAS_CUPY = importlib.util.find_spec("cupy") is not None


# --------------------------------------------------------------------------------------------------
# helpers


def _shape(layout: str, b: int, h: int, s: int, d: int) -> tuple[int, ...]:
    """A (B, H, S, D) shape in the caller's layout."""
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


class _Maker:
    """Random non-constant arrays from a seeded generator, in a given layout."""

    def __init__(self, layout: str = "bhsd", seed: int = 0) -> None:
        self.layout = layout
        self.rng = np.random.default_rng(seed)

    def __call__(self, b: int, h: int, s: int, d: int, dtype: Any = np.float32) -> np.ndarray:
        values = self.rng.standard_normal(_shape(self.layout, b, h, s, d))
        if np.dtype(dtype).kind == "c":
            values = values + 1j * self.rng.standard_normal(values.shape)
        elif np.dtype(dtype).kind in "iu":
            values = values * 10
        return values.astype(dtype)


def _valid_call(layout: str = "bhsd", dtype: Any = np.float32, seed: int = 0) -> dict[str, Any]:
    """Valid arguments for every entry point (the backward's out and lse come from the forward)."""
    make = _Maker(layout, seed)
    q, k, v = make(B, HQ, SQ, D, dtype), make(B, HKV, SK, D, dtype), make(B, HKV, SK, DV, dtype)
    out, lse = fastattn.attention(q, k, v, layout=layout, return_lse=True)
    return {
        "make": make,
        "q": q,
        "k": k,
        "v": v,
        "dout": make(B, HQ, SQ, DV, dtype),
        "out": out,
        "lse": lse,
        "kw": {"layout": layout},
    }


def _collect_arrays(obj: Any, found: list[np.ndarray]) -> list[np.ndarray]:
    if isinstance(obj, np.ndarray):
        found.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect_arrays(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect_arrays(value, found)
    elif hasattr(obj, "wrapped") and isinstance(obj.wrapped, np.ndarray):
        found.append(obj.wrapped)
    return found


def _names_argument(message: str, argname: str) -> bool:
    """The message starts with ``argname:`` (or ``a, b:`` listing it)."""
    head, colon, _ = message.partition(":")
    return bool(colon) and argname in [part.strip() for part in head.split(",")]


def expect_error(
    exc: type[BaseException], argname: str | None, call: Callable[..., Any], *args: Any, **kwargs: Any
) -> BaseException:
    """Run ``call`` expecting ``exc`` whose message starts with ``argname:``; arrays stay untouched."""
    arrays = _collect_arrays((args, kwargs), [])
    assert arrays, "the helper found no array to watch"
    snapshots = [(array, array.copy(), array.flags.writeable) for array in arrays]
    with pytest.raises(exc) as info:
        call(*args, **kwargs)
    message = str(info.value)
    if argname is not None:
        assert _names_argument(message, argname), f"message does not start with {argname!r}: {message!r}"
        _, _, rest = message.partition(":")
        assert "expected" in rest, f"message does not say what was expected: {message!r}"
    for array, before, writeable in snapshots:
        assert array.dtype == before.dtype and array.shape == before.shape
        assert np.array_equal(array, before, equal_nan=True), "a caller's array was modified"
        assert array.flags.writeable == writeable
    return info.value


def _run(api: str, a: dict[str, Any]) -> Any:
    if api == "attention":
        return fastattn.attention(a["q"], a["k"], a["v"], **a["kw"])
    if api == "attention_backward":
        return fastattn.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **a["kw"])
    if api == "explain":
        return fastattn.explain(a["q"], a["k"], a["v"], **a["kw"])
    raise AssertionError(api)


APIS = ("attention", "attention_backward", "explain")


def test_valid_call_runs_for_every_api_and_layout() -> None:
    """The base call of every case is valid, so each case's failure is due to its one change."""
    for layout in LAYOUTS:
        a = _valid_call(layout)
        for api in APIS:
            _run(api, a)
        out = fastattn.attention(a["q"], a["k"], a["v"], layout=layout)
        assert out.shape == _shape(layout, B, HQ, SQ, DV)


# --------------------------------------------------------------------------------------------------
# cases shared by attention, attention_backward and explain
#
# Each case mutates a valid call (dict from _valid_call) and names the exception and argument.


def _set(**changes: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def apply(a: dict[str, Any]) -> None:
        new = {name: make(a) for name, make in changes.items()}
        for name, value in new.items():
            if name in ("q", "k", "v", "dout", "out", "lse"):
                a[name] = value
            else:
                a["kw"][name] = value

    return apply


def _arr(b: int, h: int, s: int, d: int, dtype: Any = np.float32) -> Callable[[dict[str, Any]], np.ndarray]:
    return lambda a: a["make"](b, h, s, d, dtype)


ARRAY_CASES = [
    # not arrays
    ("q-None", _set(q=lambda a: None), TypeError, "q"),
    ("q-list", _set(q=lambda a: a["q"].tolist()), TypeError, "q"),
    ("k-None", _set(k=lambda a: None), TypeError, "k"),
    ("k-list", _set(k=lambda a: a["k"].tolist()), TypeError, "k"),
    ("v-None", _set(v=lambda a: None), TypeError, "v"),
    ("v-list", _set(v=lambda a: a["v"].tolist()), TypeError, "v"),
    ("q-float-scalar", _set(q=lambda a: 1.5), TypeError, "q"),
    ("q-numpy-scalar", _set(q=lambda a: np.float32(1.5)), TypeError, "q"),
    # unsupported dtypes
    (
        "all-int32",
        _set(q=_arr(B, HQ, SQ, D, np.int32), k=_arr(B, HKV, SK, D, np.int32), v=_arr(B, HKV, SK, DV, np.int32)),
        TypeError,
        "q",
    ),
    (
        "all-complex64",
        _set(
            q=_arr(B, HQ, SQ, D, np.complex64),
            k=_arr(B, HKV, SK, D, np.complex64),
            v=_arr(B, HKV, SK, DV, np.complex64),
        ),
        TypeError,
        "q",
    ),
    ("q-bool", _set(q=_arr(B, HQ, SQ, D, np.bool_)), TypeError, "q"),
    ("q-float8", _set(q=_arr(B, HQ, SQ, D, ml_dtypes.float8_e4m3fn)), TypeError, "q"),
    # k or v dtype differing from q
    ("k-float64", _set(k=_arr(B, HKV, SK, D, np.float64)), TypeError, "k"),
    ("k-bfloat16", _set(k=_arr(B, HKV, SK, D, BF16)), TypeError, "k"),
    ("v-float16", _set(v=_arr(B, HKV, SK, DV, np.float16)), TypeError, "v"),
    ("v-int32", _set(v=_arr(B, HKV, SK, DV, np.int32)), TypeError, "v"),
    # not 4-D
    ("q-3d", _set(q=lambda a: a["q"][0]), ValueError, "q"),
    ("q-5d", _set(q=lambda a: a["q"][None]), ValueError, "q"),
    ("k-3d", _set(k=lambda a: a["k"][0]), ValueError, "k"),
    ("v-2d", _set(v=lambda a: a["v"][0, 0]), ValueError, "v"),
    ("v-5d", _set(v=lambda a: a["v"][None]), ValueError, "v"),
    # zero sizes (batch and sequence sizes of 0 are valid: tests/conformance/test_degenerate.py)
    ("q-zero-heads", _set(q=_arr(B, 0, SQ, D)), ValueError, "q"),
    ("q-zero-dim", _set(q=_arr(B, HQ, SQ, 0), k=_arr(B, HKV, SK, 0)), ValueError, "q"),
    ("k-zero-heads", _set(k=_arr(B, 0, SK, D), v=_arr(B, 0, SK, DV)), ValueError, "k"),
    ("v-zero-dim", _set(v=_arr(B, HKV, SK, 0)), ValueError, "v"),
    # head_dim beyond MAX_HEAD_DIM (1024)
    ("q-huge-head-dim", _set(q=_arr(1, HQ, 1, 1025), k=_arr(1, HKV, 1, 1025), v=_arr(1, HKV, 1, DV)), ValueError, "q"),
    ("v-huge-head-dim", _set(v=_arr(B, HKV, SK, 4096)), ValueError, "v"),
    # shape relations
    ("hq-not-divisible", _set(k=_arr(B, 3, SK, D), v=_arr(B, 3, SK, DV)), ValueError, "k"),
    ("hkv-more-than-hq", _set(k=_arr(B, 2 * HQ, SK, D), v=_arr(B, 2 * HQ, SK, DV)), ValueError, "k"),
    ("k-head-dim", _set(k=_arr(B, HKV, SK, D + 1)), ValueError, "k"),
    ("v-seq", _set(v=_arr(B, HKV, SK + 1, DV)), ValueError, "v"),
    ("v-heads", _set(v=_arr(B, 1, SK, DV)), ValueError, "v"),
    ("k-batch", _set(k=_arr(B + 1, HKV, SK, D), v=_arr(B + 1, HKV, SK, DV)), ValueError, "k"),
    ("v-batch", _set(v=_arr(B + 1, HKV, SK, DV)), ValueError, "v"),
    # DLPack producers on devices we cannot take
    ("q-dlpack-odd-device", _set(q=lambda a: _DLPackOnDevice(a["q"], (7, 0))), TypeError, "q"),
]

OPTION_CASES = [
    # layout
    ("layout-upper", _set(layout=lambda a: "BHSD"), ValueError, "layout"),
    ("layout-other", _set(layout=lambda a: "bsdh"), ValueError, "layout"),
    ("layout-None", _set(layout=lambda a: None), ValueError, "layout"),
    ("layout-int", _set(layout=lambda a: 3), ValueError, "layout"),
    # causal
    ("causal-yes", _set(causal=lambda a: "yes"), ValueError, "causal"),
    ("causal-1.5", _set(causal=lambda a: 1.5), ValueError, "causal"),
    ("causal-bottom", _set(causal=lambda a: "bottom"), ValueError, "causal"),
    ("causal-TOP_LEFT", _set(causal=lambda a: "TOP_LEFT"), ValueError, "causal"),
    # scale
    ("scale-str", _set(scale=lambda a: "0.5"), TypeError, "scale"),
    ("scale-list", _set(scale=lambda a: [0.5]), TypeError, "scale"),
    ("scale-bool", _set(scale=lambda a: True), TypeError, "scale"),
    ("scale-array", _set(scale=lambda a: np.array([0.5])), TypeError, "scale"),
    ("scale-inf", _set(scale=lambda a: math.inf), ValueError, "scale"),
    ("scale-neg-inf", _set(scale=lambda a: -math.inf), ValueError, "scale"),
    ("scale-nan", _set(scale=lambda a: math.nan), ValueError, "scale"),
    ("scale-np-nan", _set(scale=lambda a: np.float32("nan")), ValueError, "scale"),
    # softcap
    ("softcap-zero", _set(softcap=lambda a: 0.0), ValueError, "softcap"),
    ("softcap-negative", _set(softcap=lambda a: -5.0), ValueError, "softcap"),
    ("softcap-nan", _set(softcap=lambda a: math.nan), ValueError, "softcap"),
    ("softcap-inf", _set(softcap=lambda a: math.inf), ValueError, "softcap"),
    ("softcap-str", _set(softcap=lambda a: "30"), TypeError, "softcap"),
    ("softcap-bool", _set(softcap=lambda a: True), TypeError, "softcap"),
    # window
    ("window-one-side", _set(window=lambda a: (2,)), TypeError, "window"),
    ("window-three-sides", _set(window=lambda a: (2, 2, 2)), TypeError, "window"),
    ("window-int", _set(window=lambda a: 3), TypeError, "window"),
    ("window-str", _set(window=lambda a: "ab"), TypeError, "window"),
    ("window-float-side", _set(window=lambda a: (1.0, 2)), TypeError, "window"),
    ("window-str-side", _set(window=lambda a: (1, "2")), TypeError, "window"),
    ("window-None-side", _set(window=lambda a: (None, 2)), TypeError, "window"),
    ("window-bool-side", _set(window=lambda a: (True, 0)), TypeError, "window"),
    ("window-left-below-minus-one", _set(window=lambda a: (-2, 0)), ValueError, "window"),
    ("window-right-below-minus-one", _set(window=lambda a: (0, -5)), ValueError, "window"),
    # mask
    ("mask-int32", _set(mask=lambda a: np.ones((B, HQ, SQ, SK), np.int32)), TypeError, "mask"),
    ("mask-complex", _set(mask=lambda a: np.zeros((SQ, SK), np.complex64)), TypeError, "mask"),
    ("mask-list", _set(mask=lambda a: np.ones((SQ, SK), bool).tolist()), TypeError, "mask"),
    ("mask-wrong-sk", _set(mask=lambda a: np.ones((B, HQ, SQ, SK + 1), bool)), ValueError, "mask"),
    ("mask-wrong-sq", _set(mask=lambda a: np.zeros((SQ + 1, SK), np.float32)), ValueError, "mask"),
    ("mask-kv-heads", _set(mask=lambda a: np.ones((1, HKV, SQ, SK), bool)), ValueError, "mask"),
    ("mask-wrong-batch", _set(mask=lambda a: np.ones((B + 1, 1, 1, SK), bool)), ValueError, "mask"),
    ("mask-5d", _set(mask=lambda a: np.ones((1, B, HQ, SQ, SK), bool)), ValueError, "mask"),
    # key_lengths
    ("key_lengths-float", _set(key_lengths=lambda a: np.full(B, 3.0)), TypeError, "key_lengths"),
    ("key_lengths-bool", _set(key_lengths=lambda a: np.ones(B, bool)), TypeError, "key_lengths"),
    ("key_lengths-list", _set(key_lengths=lambda a: [SK] * B), TypeError, "key_lengths"),
    ("key_lengths-long", _set(key_lengths=lambda a: np.full(B + 1, 3)), ValueError, "key_lengths"),
    ("key_lengths-2d", _set(key_lengths=lambda a: np.full((B, 1), 3)), ValueError, "key_lengths"),
    ("key_lengths-0d", _set(key_lengths=lambda a: np.array(3)), ValueError, "key_lengths"),
    ("key_lengths-negative", _set(key_lengths=lambda a: np.array([3, -1])), ValueError, "key_lengths"),
    ("key_lengths-above-sk", _set(key_lengths=lambda a: np.array([SK + 1, 2])), ValueError, "key_lengths"),
    # dropout
    ("dropout_p-negative", _set(dropout_p=lambda a: -0.1), ValueError, "dropout_p"),
    ("dropout_p-above-one", _set(dropout_p=lambda a: 1.5), ValueError, "dropout_p"),
    ("dropout_p-nan", _set(dropout_p=lambda a: math.nan), ValueError, "dropout_p"),
    ("dropout_p-str", _set(dropout_p=lambda a: "0.1"), TypeError, "dropout_p"),
    ("dropout_p-bool", _set(dropout_p=lambda a: True), TypeError, "dropout_p"),
    ("dropout_seed-negative", _set(dropout_p=lambda a: 0.1, dropout_seed=lambda a: -1), ValueError, "dropout_seed"),
    ("dropout_seed-2**64", _set(dropout_p=lambda a: 0.1, dropout_seed=lambda a: 2**64), ValueError, "dropout_seed"),
    ("dropout_seed-float", _set(dropout_p=lambda a: 0.1, dropout_seed=lambda a: 1.5), TypeError, "dropout_seed"),
    (
        "dropout_offset-negative",
        _set(dropout_seed=lambda a: 1, dropout_offset=lambda a: -1),
        ValueError,
        "dropout_offset",
    ),
    (
        "dropout_offset-2**32",
        _set(dropout_seed=lambda a: 1, dropout_offset=lambda a: 2**32),
        ValueError,
        "dropout_offset",
    ),
    ("dropout_offset-None", _set(dropout_offset=lambda a: None), TypeError, "dropout_offset"),
    # backend argument
    ("backend-unknown", _set(backend=lambda a: "nope"), ValueError, "backend"),
    ("backend-int", _set(backend=lambda a: 3), TypeError, "backend"),
    ("backend-bytes", _set(backend=lambda a: b"reference"), TypeError, "backend"),
    ("backend-list", _set(backend=lambda a: ["reference"]), TypeError, "backend"),
]

FORWARD_ONLY_CASES = [
    ("return_lse-str", _set(return_lse=lambda a: "yes"), TypeError, "return_lse"),
    ("return_lse-int", _set(return_lse=lambda a: 1), TypeError, "return_lse"),
    ("return_lse-None", _set(return_lse=lambda a: None), TypeError, "return_lse"),
]

BACKWARD_ONLY_CASES = [
    ("dout-None", _set(dout=lambda a: None), TypeError, "dout"),
    ("dout-list", _set(dout=lambda a: a["dout"].tolist()), TypeError, "dout"),
    ("dout-float64", _set(dout=_arr(B, HQ, SQ, DV, np.float64)), TypeError, "dout"),
    ("dout-wrong-dv", _set(dout=_arr(B, HQ, SQ, DV + 1)), ValueError, "dout"),
    ("dout-wrong-seq", _set(dout=_arr(B, HQ, SQ + 1, DV)), ValueError, "dout"),
    ("dout-kv-heads", _set(dout=_arr(B, HKV, SQ, DV)), ValueError, "dout"),
    ("dout-3d", _set(dout=lambda a: a["dout"][0]), ValueError, "dout"),
    ("out-None", _set(out=lambda a: None), TypeError, "out"),
    ("out-float16", _set(out=_arr(B, HQ, SQ, DV, np.float16)), TypeError, "out"),
    ("out-wrong-seq", _set(out=_arr(B, HQ, SQ + 1, DV)), ValueError, "out"),
    ("out-wrong-batch", _set(out=_arr(B + 1, HQ, SQ, DV)), ValueError, "out"),
    ("lse-None", _set(lse=lambda a: None), TypeError, "lse"),
    ("lse-float64", _set(lse=lambda a: a["lse"].astype(np.float64)), TypeError, "lse"),
    ("lse-float16", _set(lse=lambda a: a["lse"].astype(np.float16)), TypeError, "lse"),
    ("lse-wrong-seq", _set(lse=lambda a: np.zeros((B, HQ, SQ + 1), np.float32)), ValueError, "lse"),
    ("lse-kv-heads", _set(lse=lambda a: np.zeros((B, HKV, SQ), np.float32)), ValueError, "lse"),
    ("lse-4d", _set(lse=lambda a: a["lse"][..., None]), ValueError, "lse"),
    ("lse-2d", _set(lse=lambda a: a["lse"][0]), ValueError, "lse"),
    ("deterministic-int", _set(deterministic=lambda a: 1), TypeError, "deterministic"),
    ("deterministic-str", _set(deterministic=lambda a: "yes"), TypeError, "deterministic"),
    ("deterministic-None", _set(deterministic=lambda a: None), TypeError, "deterministic"),
]


class _DLPackOnDevice:
    """A DLPack producer that claims to live on another device."""

    def __init__(self, wrapped: np.ndarray, device: tuple[int, int]) -> None:
        self.wrapped = wrapped
        self.device = device

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.wrapped.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def _params(cases: list[tuple[Any, ...]], apis: tuple[str, ...]) -> list[Any]:
    return [
        pytest.param(api, layout, mutate, exc, argname, id=f"{api}-{layout}-{case_id}")
        for case_id, mutate, exc, argname in cases
        for api in apis
        for layout in LAYOUTS
    ]


ALL_ERROR_PARAMS = (
    _params(ARRAY_CASES + OPTION_CASES, APIS)
    + _params(FORWARD_ONLY_CASES, ("attention",))
    + _params(BACKWARD_ONLY_CASES, ("attention_backward",))
)


@pytest.mark.parametrize(("api", "layout", "mutate", "exc", "argname"), ALL_ERROR_PARAMS)
def test_bad_input(api: str, layout: str, mutate: Any, exc: type[Exception], argname: str) -> None:
    a = _valid_call(layout, seed=zlib.crc32(f"{api}-{layout}".encode()))
    mutate(a)
    expect_error(exc, argname, _run, api, a)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("k", (B, HKV, SK, D + 1)),
        ("v", (B, HKV, SK + 1, DV)),
        ("k", (B + 1, HKV, SK, D)),
    ],
)
def test_shape_message_is_in_callers_layout(layout: str, name: str, shape: tuple[int, ...]) -> None:
    """A shape error shows the received shape as the caller passed it (bshd: (B, S, H, D))."""
    a = _valid_call(layout)
    a[name] = a["make"](*shape)
    if name == "k" and shape[0] != B:
        a["v"] = a["make"](shape[0], HKV, SK, DV)
    error = expect_error(ValueError, name, _run, "attention", a)
    assert str(a[name].shape) in str(error)


@pytest.mark.parametrize(
    ("dtype", "wrong_lse_dtype"),
    [(np.float32, np.float64), (np.float64, np.float32), (BF16, np.float64), (np.float16, np.float16)],
)
def test_backward_lse_dtype_follows_accumulation_dtype(dtype: Any, wrong_lse_dtype: Any) -> None:
    """lse must be float32 for fp16/bf16/fp32 inputs and float64 for float64 inputs."""
    a = _valid_call("bhsd", dtype=dtype)
    assert a["lse"].dtype == (np.float64 if dtype == np.float64 else np.float32)
    fastattn.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"])
    a["lse"] = a["lse"].astype(wrong_lse_dtype)
    expect_error(TypeError, "lse", _run, "attention_backward", a)


# --------------------------------------------------------------------------------------------------
# explicitly requested backends that cannot run the call


_DECLINE_REASON = "toy_declines takes no problem at all"


class _DecliningBackend:
    """A registered backend that declines every problem, forward and backward."""

    name = "toy_declines"
    devices = ("cpu",)
    priority = -1

    def not_supported_reasons(self, problem: Any) -> list[str]:
        return [_DECLINE_REASON]

    def forward(self, *args: Any) -> Any:
        raise AssertionError("a declining backend must never be run")

    backward = forward


@pytest.fixture
def declining_backend() -> Any:
    fastattn.backends.register(_DecliningBackend())
    yield "toy_declines"
    fastattn.backends.unregister("toy_declines")


@pytest.mark.parametrize("api", ["attention", "attention_backward"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_explicit_backend_that_declines_raises_with_reasons(api: str, layout: str, declining_backend: str) -> None:
    """Asking for a backend that declines the call must not fall back silently."""
    a = _valid_call(layout)
    a["kw"]["backend"] = declining_backend
    error = expect_error(fastattn.UnsupportedError, None, _run, api, a)
    assert error.reasons == [_DECLINE_REASON]
    assert declining_backend in str(error) and _DECLINE_REASON in str(error)


def _qkv(layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = _valid_call(layout)
    return a["q"], a["k"], a["v"]


@pytest.mark.parametrize("api", ["attention", "attention_backward"])
def test_explicit_unavailable_backend_raises_unsupported(api: str) -> None:
    status = fastattn.backends.available()["cuda"]
    if status.available:
        pytest.skip("the cuda backend is available here")
    a = _valid_call()
    a["kw"]["backend"] = "cuda"
    error = expect_error(fastattn.UnsupportedError, None, _run, api, a)
    assert error.reasons == [status.detail]


def test_explain_with_declining_explicit_backend_reports_instead_of_raising(declining_backend: str) -> None:
    a = _valid_call()
    explanation = fastattn.explain(a["q"], a["k"], a["v"], backend=declining_backend)
    assert explanation.reasons[declining_backend] == [_DECLINE_REASON]
    assert explanation.chosen is None
    assert "backend=" in explanation.source


def test_unsupported_error_is_a_runtime_error_with_reasons() -> None:
    error = fastattn.UnsupportedError("headline", ["first reason", "second reason"])
    assert isinstance(error, RuntimeError)
    assert error.reasons == ["first reason", "second reason"]
    assert str(error).splitlines() == ["headline", "  - first reason", "  - second reason"]
    assert fastattn.UnsupportedError("only a headline").reasons == []


# --------------------------------------------------------------------------------------------------
# scaled_dot_product_attention


def _sdpa_inputs(hq: int = HQ, hkv: int = HQ, seed: int = 3) -> dict[str, Any]:
    make = _Maker("bhsd", seed)
    return {"query": make(B, hq, SQ, D), "key": make(B, hkv, SK, D), "value": make(B, hkv, SK, DV)}


def test_sdpa_valid_base_call() -> None:
    inputs = _sdpa_inputs()
    out = fastattn.scaled_dot_product_attention(**inputs)
    assert out.shape == (B, HQ, SQ, DV)
    three_d = {name: array[:, 0] for name, array in inputs.items()}
    assert fastattn.scaled_dot_product_attention(**three_d).shape == (B, SQ, DV)


SDPA_CASES = [
    ("dropout-negative", {"dropout_p": -0.1}, ValueError, "dropout_p"),
    ("dropout-two", {"dropout_p": 2}, ValueError, "dropout_p"),
    ("dropout-nan", {"dropout_p": math.nan}, ValueError, "dropout_p"),
    ("dropout-str", {"dropout_p": "0.1"}, TypeError, "dropout_p"),
    ("dropout-bool", {"dropout_p": True}, TypeError, "dropout_p"),
    ("is_causal-str", {"is_causal": "yes"}, TypeError, "is_causal"),
    ("enable_gqa-int", {"enable_gqa": 1}, TypeError, "enable_gqa"),
    ("causal-with-mask", {"is_causal": True, "attn_mask": np.ones((SQ, SK), bool)}, ValueError, "attn_mask"),
    ("scale-inf", {"scale": math.inf}, ValueError, "scale"),
    ("scale-str", {"scale": "1"}, TypeError, "scale"),
]


@pytest.mark.parametrize(("changes", "exc", "argname"), [c[1:] for c in SDPA_CASES], ids=[c[0] for c in SDPA_CASES])
def test_sdpa_bad_option(changes: dict[str, Any], exc: type[Exception], argname: str) -> None:
    inputs = _sdpa_inputs()
    expect_error(exc, argname, fastattn.scaled_dot_product_attention, **inputs, **changes)


def test_sdpa_dropout_runs_and_drops() -> None:
    """dropout_p is applied, like PyTorch's: 1 drops everything, and two calls draw different masks."""
    inputs = _sdpa_inputs()
    assert np.all(fastattn.scaled_dot_product_attention(**inputs, dropout_p=1.0) == 0)
    first = fastattn.scaled_dot_product_attention(**inputs, dropout_p=0.5)
    assert not np.array_equal(first, fastattn.scaled_dot_product_attention(**inputs, dropout_p=0.5))


def test_sdpa_gqa_needs_enable_gqa() -> None:
    inputs = _sdpa_inputs(hq=HQ, hkv=HKV)
    expect_error(ValueError, "key", fastattn.scaled_dot_product_attention, **inputs)
    out = fastattn.scaled_dot_product_attention(**inputs, enable_gqa=True)
    assert out.shape == (B, HQ, SQ, DV)


@pytest.mark.parametrize(
    ("name", "index", "argname"),
    [
        ("query", (0, 0), "query"),  # 2-D
        ("query", (None,), "query"),  # 5-D
        ("key", (None,), "key"),
        ("value", (0, 0), "value"),
    ],
)
def test_sdpa_bad_rank(name: str, index: tuple[Any, ...], argname: str) -> None:
    inputs = _sdpa_inputs()
    inputs[name] = inputs[name][index]
    expect_error(ValueError, argname, fastattn.scaled_dot_product_attention, **inputs)


@pytest.mark.parametrize("name", ["key", "value"])
def test_sdpa_mixed_rank(name: str) -> None:
    inputs = _sdpa_inputs()
    inputs[name] = inputs[name][:, 0]  # 3-D while query is 4-D
    expect_error(ValueError, name, fastattn.scaled_dot_product_attention, **inputs)


@pytest.mark.parametrize(
    ("changes", "exc", "argname"),
    [
        pytest.param(
            {"query": None}, TypeError, "query",
            id="query-None",
        ),
        pytest.param(
            {"query": [[1.0]]}, TypeError, "query",
            id="query-list",
        ),
        pytest.param(
            {"key": None}, TypeError, "key",
            id="key-None",
        ),
        pytest.param(
            {"query": "int32"}, TypeError, "query",
            id="query-int32",
        ),
        pytest.param(
            {"value": "float64"}, TypeError, "value",
            id="value-float64",
        ),
        pytest.param(
            {"attn_mask": np.ones((SQ, SK), np.int32)}, TypeError, "attn_mask",
            id="attn_mask-int32",
        ),
        pytest.param(
            {"attn_mask": np.ones((SQ + 1, SK), bool)}, ValueError, "attn_mask",
            id="attn_mask-shape",
        ),
        pytest.param(
            {"key": "3-heads", "enable_gqa": True}, ValueError, "key",
            id="gqa-not-divisible",
        ),
    ],
)
def test_sdpa_messages_name_sdpa_arguments(changes: dict[str, Any], exc: type[Exception], argname: str) -> None:
    inputs = _sdpa_inputs()
    make = _Maker("bhsd", 9)
    for name, value in changes.items():
        if isinstance(value, str) and value == "int32":
            value = inputs[name].astype(np.int32)
        elif isinstance(value, str) and value == "float64":
            value = inputs[name].astype(np.float64)
        elif isinstance(value, str) and value == "3-heads":
            inputs["value"] = make(B, 3, SK, DV)
            value = make(B, 3, SK, D)
        inputs[name] = value
    expect_error(exc, argname, fastattn.scaled_dot_product_attention, **inputs)


# --------------------------------------------------------------------------------------------------
# use_backend


def test_use_backend_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"^name:"):
        with fastattn.use_backend("nope"):
            pass


@pytest.mark.parametrize("name", [3, b"reference", ["reference"]])
def test_use_backend_not_a_string(name: Any) -> None:
    with pytest.raises(TypeError, match=r"^name:"):
        with fastattn.use_backend(name):
            pass


def test_use_backend_bad_name_leaves_selection_alone() -> None:
    q, k, v = _qkv("bhsd")
    before = fastattn.explain(q, k, v)
    with pytest.raises(ValueError):
        with fastattn.use_backend("nope"):
            pass
    after = fastattn.explain(q, k, v)
    assert (after.chosen, after.source) == (before.chosen, before.source)


# --------------------------------------------------------------------------------------------------
# error paths of the array layer (devices, exotic torch tensors)


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here")
def test_cuda_dlpack_without_cupy_names_argument() -> None:
    a = _valid_call()
    a["k"] = _DLPackOnDevice(a["k"], (2, 0))
    expect_error(TypeError, "k", _run, "attention", a)


def _torch() -> Any:
    return pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("dtype_name", "argname"),
    [("int32", "q"), ("complex64", "q"), ("uint8", "q")],
)
def test_torch_unsupported_dtype(dtype_name: str, argname: str) -> None:
    torch = _torch()
    q = torch.from_numpy(_Maker("bhsd", 5)(B, HQ, SQ, D, np.float32))
    k = torch.from_numpy(_Maker("bhsd", 6)(B, HKV, SK, D, np.float32))
    v = torch.from_numpy(_Maker("bhsd", 7)(B, HKV, SK, DV, np.float32))
    bad = q.to(getattr(torch, dtype_name))
    with pytest.raises(TypeError, match=rf"^{argname}:"):
        fastattn.attention(bad, k, v)


def test_torch_meta_tensor_names_argument() -> None:
    torch = _torch()
    q = torch.empty(B, HQ, SQ, D, device="meta")
    k = torch.randn(B, HKV, SK, D)
    v = torch.randn(B, HKV, SK, DV)
    with pytest.raises(TypeError, match=r"^q:"):
        fastattn.attention(q, k, v)


def test_torch_float8_is_a_type_error() -> None:
    torch = _torch()
    k = torch.randn(B, HKV, SK, D)
    v = torch.randn(B, HKV, SK, DV)
    q = torch.randn(B, HQ, SQ, D).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"^q:"):
        fastattn.attention(q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))


def test_torch_sparse_tensor_is_a_type_error() -> None:
    torch = _torch()
    q = torch.randn(B, HQ, SQ, D)
    k = torch.randn(B, HKV, SK, D).to_sparse()
    v = torch.randn(B, HKV, SK, DV)
    with pytest.raises(TypeError, match=r"^k:"):
        fastattn.attention(q, k, v)


def test_torch_inputs_untouched_on_error() -> None:
    torch = _torch()
    q = torch.randn(B, HQ, SQ, D, generator=torch.Generator().manual_seed(0))
    k = torch.randn(B, HKV, SK, D, generator=torch.Generator().manual_seed(1))
    v = torch.randn(B, HKV, SK, DV, generator=torch.Generator().manual_seed(2))
    copies = [t.clone() for t in (q, k, v)]
    with pytest.raises(ValueError, match=r"^window:"):
        fastattn.attention(q, k, v, window=(-3, 1))
    with pytest.raises(TypeError, match=r"^mask:"):
        fastattn.attention(q, k, v, mask=torch.ones(SQ, SK, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^key_lengths:"):
        fastattn.attention(q, k, v, key_lengths=torch.tensor([SK + 1, 1]))
    for tensor, copy in zip((q, k, v), copies):
        assert torch.equal(tensor, copy)


# --------------------------------------------------------------------------------------------------
# valid-looking extreme values must not escape as other exceptions or give silently wrong results


@pytest.mark.parametrize(
    "window", [(-1, 2**63 - 1), (2**70, 0), (0, 2**64)], ids=["right-maxsize", "left-2**70", "right-2**64"]
)
def test_window_huge_sides(window: tuple[int, int]) -> None:
    """A side larger than any sequence is unbounded; if refused, it must be a ValueError naming window."""
    a = _valid_call()
    left, right = window
    unbounded = fastattn.attention(
        a["q"], a["k"], a["v"], window=(-1 if left > SK else left, -1 if right > SK else right)
    )
    try:
        out = fastattn.attention(a["q"], a["k"], a["v"], window=window)
    except ValueError as error:
        assert str(error).startswith("window:")
    else:
        np.testing.assert_allclose(out, unbounded, rtol=1e-6, atol=1e-6)


def test_sdpa_accepts_numpy_float_dropout_zero() -> None:
    inputs = _sdpa_inputs()
    want = fastattn.scaled_dot_product_attention(**inputs)
    got = fastattn.scaled_dot_product_attention(**inputs, dropout_p=np.float32(0.0))
    np.testing.assert_array_equal(got, want)
