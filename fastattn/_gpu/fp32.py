"""Launchers of the exact float32 kernels (``kernels/flash_fp32.cu``): forward and backward.

SIMT float32 throughout (no TF32: ``allow_tf32`` is not offered yet), so results agree with
float64 to float32 rounding.  One head-dimension bucket (32, 64, 128 or 256) covers ``max(D, Dv)``;
any element strides with a contiguous last axis work.  The backward is three launches: the delta
pre-pass, dK/dV over key blocks (deterministic sum over the GQA group), dQ over query blocks
(a second pass instead of atomics: deterministic).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import _arrays
from .._problem import AttentionExtras, AttentionProblem
from . import _launch

SOURCE = "flash_fp32.cu"
BUCKETS = (32, 64, 128, 256)
MAX_HEAD_DIM = BUCKETS[-1]
THREADS = 256


def not_supported_reasons(problem: AttentionProblem) -> list[str]:
    """Why the float32 kernels cannot run ``problem`` (forward or backward); empty when they can."""
    reasons = []
    if max(problem.head_dim, problem.head_dim_v) > MAX_HEAD_DIM:
        reasons.append(
            f"float32 takes head_dim and Dv up to {MAX_HEAD_DIM}, "
            f"received D={problem.head_dim}, Dv={problem.head_dim_v}"
        )
    if problem.mask == "float" and problem.mask_dtype not in _launch.MASK_KINDS:
        reasons.append(f"takes float masks in float32/float16/bfloat16, not {problem.mask_dtype}")
    return reasons


def bucket(problem: AttentionProblem) -> int:
    """The kernels' DMAX: the smallest bucket holding both D and Dv."""
    size = max(problem.head_dim, problem.head_dim_v)
    return next(b for b in BUCKETS if b >= size)


def _keys(dmax: int) -> int:
    """Keys per tile of the forward and of the dK/dV kernel (mirrors ``Fp32Shape``)."""
    return 64 if dmax <= 128 else 32


def forward_shared_bytes(dmax: int) -> int:
    """Q tile (64 rows), K and V tiles, P tile; odd row strides."""
    stride, keys = dmax + 1, _keys(dmax)
    return 4 * (64 * stride + 2 * keys * stride + 64 * (keys + 1))


def kv_shared_bytes(dmax: int) -> int:
    """K, V tiles, Q and dO tiles (32 rows), P^T and dS^T tiles, lse and delta of 32 rows."""
    stride, keys, rows = dmax + 1, _keys(dmax), 32
    return 4 * (2 * keys * stride + 2 * rows * stride + 2 * keys * (rows + 1) + 2 * rows)


def q_rows(dmax: int) -> int:
    """Query rows per block of the dQ kernel (mirrors ``Fp32Shape::kQM``)."""
    return 64 if dmax <= 128 else 32


def q_shared_bytes(dmax: int) -> int:
    """Q, dO tiles, K, V tiles (32 keys), dS tile, lse and delta."""
    stride, rows, keys = dmax + 1, q_rows(dmax), 32
    return 4 * (2 * rows * stride + 2 * keys * stride + rows * (keys + 1) + 2 * rows)


def _sizes(problem: AttentionProblem) -> list[Any]:
    return [
        np.int32(problem.seq_q), np.int32(problem.seq_k), np.int32(problem.head_dim), np.int32(problem.head_dim_v),
    ]  # fmt: skip


def forward(problem: AttentionProblem, q: Any, k: Any, v: Any, out: Any, lse: Any, extras: AttentionExtras) -> None:
    """Launch the float32 forward on (B, H, S, D)-ordered CuPy arrays, writing ``out`` and ``lse``.

    Parameters
    ----------
    q, k, v : cupy.ndarray
        float32 ``(B, Hq, Sq, D)``, ``(B, Hkv, Sk, D)``, ``(B, Hkv, Sk, Dv)``.
    out : cupy.ndarray
        float32 ``(B, Hq, Sq, Dv)``, written.
    lse : cupy.ndarray
        float32 ``(B, Hq, Sq)`` with a contiguous last axis, written (natural log).
    """
    dmax = bucket(problem)
    arguments = [
        q, k, v, out, lse,
        *_launch.strides3(q), *_launch.strides3(k), *_launch.strides3(v), *_launch.strides3(out),
        *_launch.strides2(lse), *_sizes(problem), np.int32(problem.group_size),
        np.float32(problem.scale), np.float32(problem.softcap or 0.0),
        *_launch.rule_arguments(problem, extras),
    ]  # fmt: skip
    shared = forward_shared_bytes(dmax)
    grid = (math.ceil(problem.seq_q / 64), problem.heads_q, problem.batch)
    with _launch.stream(problem.framework):
        _launch.compiled(SOURCE, f"fastattn_gpu::fp32_forward<{dmax}>", shared)(
            grid, (THREADS,), tuple(arguments), shared_mem=shared
        )


def backward(
    problem: AttentionProblem, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, extras: AttentionExtras
) -> tuple[Any, Any, Any]:
    """Return ``(dq, dk, dv)`` for float32 (B, H, S, D)-ordered CuPy arrays.

    Parameters
    ----------
    dout, out : cupy.ndarray
        float32 ``(B, Hq, Sq, Dv)``.
    q, k, v : cupy.ndarray
        The forward's inputs.
    lse : cupy.ndarray
        float32 ``(B, Hq, Sq)``, the forward's natural-log lse.

    Returns
    -------
    dq, dk, dv : cupy.ndarray
        In the shapes of q, k, v, float32, allocated contiguous in the problem's layout; dk and dv
        summed over each kv head's query group.
    """
    xp = _launch.array_module()

    dmax = bucket(problem)
    dq, dk, dv = (_arrays.empty_bhsd(xp, x.shape, x.dtype, problem.layout) for x in (q, k, v))
    lse = xp.ascontiguousarray(lse)
    delta = xp.empty((problem.batch, problem.heads_q, problem.seq_q), dtype=xp.float32)
    rows = problem.batch * problem.heads_q * problem.seq_q
    common = [
        *_sizes(problem), np.int32(problem.heads_q), np.int32(problem.group_size),
        np.float32(problem.scale), np.float32(problem.softcap or 0.0),
        *_launch.rule_arguments(problem, extras),
    ]  # fmt: skip
    inputs = [*_launch.strides3(q), *_launch.strides3(k), *_launch.strides3(v), *_launch.strides3(dout)]
    kv_arguments = [
        q, k, v, dout, lse, delta, dk, dv, *inputs, *_launch.strides2(lse),
        *_launch.strides3(dk), *_launch.strides3(dv), *common,
    ]  # fmt: skip
    q_arguments = [q, k, v, dout, lse, delta, dq, *inputs, *_launch.strides2(lse), *_launch.strides3(dq), *common]
    kv_shared, q_shared = kv_shared_bytes(dmax), q_shared_bytes(dmax)
    with _launch.stream(problem.framework):
        _launch.compiled(SOURCE, "fastattn_gpu::fp32_delta", 0)(
            (math.ceil(rows / (THREADS // 32)),),
            (THREADS,),
            (
                dout, out, delta, *_launch.strides3(dout), *_launch.strides3(out),
                np.int32(problem.heads_q), np.int32(problem.seq_q), np.int32(problem.head_dim_v), np.int64(rows),
            ),
        )  # fmt: skip
        _launch.compiled(SOURCE, f"fastattn_gpu::fp32_backward_kv<{dmax}>", kv_shared)(
            (math.ceil(problem.seq_k / _keys(dmax)), problem.heads_kv, problem.batch),
            (THREADS,),
            tuple(kv_arguments),
            shared_mem=kv_shared,
        )
        _launch.compiled(SOURCE, f"fastattn_gpu::fp32_backward_q<{dmax}>", q_shared)(
            (math.ceil(problem.seq_q / q_rows(dmax)), problem.heads_q, problem.batch),
            (THREADS,),
            tuple(q_arguments),
            shared_mem=q_shared,
        )
    return dq, dk, dv
