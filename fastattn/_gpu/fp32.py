"""Launchers of the exact float32 kernels (``kernels/flash_fp32.cu``): forward and backward.

SIMT float32 throughout (no TF32: ``allow_tf32`` is not offered yet), so results agree with
float64 to float32 rounding.  The forward is two launches: the walk over the keys, then a rerun
of the blocks whose outputs came out non-finite (most exit at once).  One head-dimension bucket
(32, 64, 128 or 256) covers ``max(D, Dv)``; any element strides with a contiguous last axis work.
The backward is three launches: the delta pre-pass, dK/dV over key blocks (deterministic sum over
the GQA group), dQ over query blocks (a second pass instead of atomics: deterministic).  Dropout
runs in the ``DROPOUT`` instances.  Every launch of a call passes its one ``Params`` record
(``params.py``).
"""

from __future__ import annotations

import math
from typing import Any

from .. import _arrays
from .._problem import AttentionExtras, AttentionProblem
from . import _launch, params

SOURCE = "flash_fp32.cu"
DTYPES = ("float32",)
BUCKETS = (32, 64, 128, 256)
MAX_HEAD_DIM = BUCKETS[-1]
THREADS = 256


def declines(problem: AttentionProblem) -> list[str]:
    """Why the float32 kernels cannot run ``problem`` (forward or backward); empty when they can."""
    reasons = []
    if max(problem.head_dim, problem.head_dim_v) > MAX_HEAD_DIM:
        reasons.append(
            f"float32 takes head_dim and Dv up to {MAX_HEAD_DIM}, "
            f"received D={problem.head_dim}, Dv={problem.head_dim_v}"
        )
    if problem.mask == "float" and problem.mask_dtype not in params.MASK_KINDS:
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


def forward_problem_shared_bytes(problem: AttentionProblem) -> int:
    """The forward's dynamic shared memory for ``problem`` (the kernel table's form)."""
    return forward_shared_bytes(bucket(problem))


def backward_problem_shared_bytes(problem: AttentionProblem) -> int:
    """The most dynamic shared memory one backward block of ``problem`` asks for."""
    return max(kv_shared_bytes(bucket(problem)), q_shared_bytes(bucket(problem)))


def _flag(problem: AttentionProblem) -> str:
    return "true" if problem.dropout_p > 0 else "false"


def forward_instances(problem: AttentionProblem) -> tuple[str, ...]:
    """The kernel instances that run ``problem``'s forward, in launch order: the walk, then the rerun
    of the blocks whose outputs came out non-finite (see ``fp32_forward``'s RERUN)."""
    name = f"fastattn_gpu::fp32_forward<{bucket(problem)}, {_flag(problem)}"
    return (f"{name}, false>", f"{name}, true>")


def backward_instances(problem: AttentionProblem) -> tuple[str, ...]:
    """The kernel instances that run ``problem``'s backward, in launch order."""
    dmax, flag = bucket(problem), _flag(problem)
    return (
        "fastattn_gpu::fp32_delta",
        f"fastattn_gpu::fp32_backward_kv<{dmax}, {flag}>",
        f"fastattn_gpu::fp32_backward_q<{dmax}, {flag}>",
    )


def all_forward_instances() -> tuple[str, ...]:
    """Every instance :func:`forward_instances` can name (CI's nvcc compiles each)."""
    return tuple(
        f"fastattn_gpu::fp32_forward<{dmax}, {flag}, {rerun}>"
        for dmax in BUCKETS
        for flag in ("false", "true")
        for rerun in ("false", "true")
    )


def all_backward_instances() -> tuple[str, ...]:
    """Every instance :func:`backward_instances` can name (CI's nvcc compiles each)."""
    return ("fastattn_gpu::fp32_delta",) + tuple(
        f"fastattn_gpu::fp32_backward_{part}<{dmax}, {flag}>"
        for part in ("kv", "q")
        for dmax in BUCKETS
        for flag in ("false", "true")
    )


def forward(problem: AttentionProblem, q: Any, k: Any, v: Any, out: Any, lse: Any, extras: AttentionExtras) -> None:
    """Launch the float32 forward on (B, H, S, D)-ordered CuPy arrays, writing ``out`` and ``lse``.

    Parameters
    ----------
    q, k, v : cupy.ndarray
        float32 ``(B, Hq, Sq, D)``, ``(B, Hkv, Sk, D)``, ``(B, Hkv, Sk, Dv)``.
    out : cupy.ndarray
        float32 ``(B, Hq, Sq, Dv)``, written.
    lse : cupy.ndarray
        float32 ``(B, Hq, Sq)``, written (natural log).
    """
    record = params.from_problem(problem, extras)
    for name, array in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        params.set_operand(record, name, array)
    shared = forward_shared_bytes(bucket(problem))
    grid = (math.ceil(problem.seq_q / 64), problem.heads_q, problem.batch)
    argument = params.argument(record)
    with _launch.stream(problem.framework):
        for name in forward_instances(problem):
            _launch.compiled(SOURCE, name, shared)(grid, (THREADS,), argument, shared_mem=shared)


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
    record = params.from_problem(problem, extras)
    operands = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    for name, array in operands.items():
        params.set_operand(record, name, array)
    delta_name, kv_name, q_name = backward_instances(problem)
    kv_shared, q_shared = kv_shared_bytes(dmax), q_shared_bytes(dmax)
    with _launch.stream(problem.framework):
        delta = xp.empty((problem.batch, problem.heads_q, problem.seq_q), dtype=xp.float32)
        params.set_pointer(record, "delta", delta)
        argument = params.argument(record)
        rows = problem.batch * problem.heads_q * problem.seq_q
        _launch.compiled(SOURCE, delta_name, 0)((math.ceil(rows / (THREADS // 32)),), (THREADS,), argument)
        _launch.compiled(SOURCE, kv_name, kv_shared)(
            (math.ceil(problem.seq_k / _keys(dmax)), problem.heads_kv, problem.batch),
            (THREADS,),
            argument,
            shared_mem=kv_shared,
        )
        _launch.compiled(SOURCE, q_name, q_shared)(
            (math.ceil(problem.seq_q / q_rows(dmax)), problem.heads_q, problem.batch),
            (THREADS,),
            argument,
            shared_mem=q_shared,
        )
    return dq, dk, dv
