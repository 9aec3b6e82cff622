"""Launcher of the split-KV decode kernels and their combine kernel (``kernels/flash_decode.cu``).

The cuda backend sends a forward here when :func:`declines` has no reason (``Sq <= 16``, the
KV-cache step, no dropout; ``fastattn/_gpu/ops.py``).  One block handles (key split, kv head, chunk
of packed GQA rows, batch row): float16 and bfloat16 run ``flash_decode`` on tensor cores, 16 packed
rows a block; float32 runs ``flash_decode_fp32`` in SIMT float32 math, 4 or 8 rows a block.  With
more than one split the partial results (float32, normalised, plus a partial lse each) are merged
by ``decode_combine``.

Split count (:func:`plan`): enough blocks to fill the device, never splits so short that the
per-block prologue (loading the packed queries, the first tile) outweighs the streaming::

    items  = B * Hkv * ceil(group * Sq / rows)         # blocks without splitting
    splits = min(ceil(BLOCKS_PER_SM * SMs / items),    # about BLOCKS_PER_SM resident blocks per SM
                 ceil(Sk / MIN_KEYS_PER_SPLIT))        # each split streams >= 256 keys

then rounded so that every split but the last holds a whole number of key tiles.  G7 on an H100
(132 SMs): items = 256, splits = 3.  ``key_lengths`` are not read on the host (no device sync):
splits past a row's length exit after writing lse = -inf.  These constants are starting points
that the G7 benchmark on a GPU has to confirm (issue #13).
"""

from __future__ import annotations

import math
from typing import Any

from .._problem import AttentionExtras, AttentionProblem
from . import _launch, params

SOURCE = "flash_decode.cu"
HEAD_DIMS = (32, 64, 128, 256)
MAX_QUERIES = 16
THREADS = 128
WARPS = THREADS // 32
TENSOR_CORE_ROWS = 16
BLOCKS_PER_SM = 4
MIN_KEYS_PER_SPLIT = 256
_ELEMENTS = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
DTYPES = tuple(_ELEMENTS)
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def declines(problem: AttentionProblem) -> list[str]:
    """Why the decode kernel does not run this forward (empty: it does; the cuda backend's fast path).

    It takes Sq <= 16, float16/bfloat16/float32, D == Dv in ``HEAD_DIMS``, K and V rows 16-byte
    aligned, a mask the kernels read, and no dropout (inference does not use it; such calls run on
    the general forward).
    """
    reasons = []
    if problem.seq_q > MAX_QUERIES:
        reasons.append(f"takes Sq <= {MAX_QUERIES}, received {problem.seq_q}")
    if problem.head_dim not in HEAD_DIMS or problem.head_dim_v != problem.head_dim:
        reasons.append(f"takes D == Dv in {HEAD_DIMS}, received D={problem.head_dim}, Dv={problem.head_dim_v}")
    vector = 16 // _ITEMSIZE.get(problem.dtype, 16)
    if any(stride % vector for stride in (*problem.k_strides[:3], *problem.v_strides[:3])):
        reasons.append("needs K and V row strides of whole 16-byte chunks")
    if problem.mask == "float" and problem.mask_dtype not in params.MASK_KINDS:
        reasons.append(f"takes float masks in float32/float16/bfloat16, not {problem.mask_dtype}")
    if problem.dropout_p > 0:
        reasons.append("runs no dropout (inference does not use it)")
    return reasons


def instances(problem: AttentionProblem) -> tuple[str, ...]:
    """The kernel instances that run ``problem``, in launch order: the decode (float32: then its
    rerun of the blocks whose outputs came out non-finite), then the combine when it splits."""
    return _instances(problem, plan(problem, _launch.multiprocessors())[0])


def _instances(problem: AttentionProblem, splits: int) -> tuple[str, ...]:
    element = _ELEMENTS[problem.dtype]
    decodes: tuple[str, ...]
    if problem.dtype == "float32":
        rows = rows_per_block(problem)
        name = f"fastattn_gpu::flash_decode_fp32<{problem.head_dim}, {rows}"
        decodes = (f"{name}, false>", f"{name}, true>")
    else:
        softcap = "true" if problem.softcap is not None else "false"
        decodes = (f"fastattn_gpu::flash_decode<{element}, {problem.head_dim}, {softcap}>",)
    return decodes if splits == 1 else (*decodes, f"fastattn_gpu::decode_combine<{element}>")


def all_instances() -> tuple[str, ...]:
    """Every instance :func:`instances` can name (CI's nvcc compiles each)."""
    tensor_cores = tuple(
        f"fastattn_gpu::flash_decode<{_ELEMENTS[dtype]}, {head_dim}, {softcap}>"
        for dtype in ("float16", "bfloat16")
        for head_dim in HEAD_DIMS
        for softcap in ("false", "true")
    )
    simt = tuple(
        f"fastattn_gpu::flash_decode_fp32<{head_dim}, {rows}, {rerun}>"
        for head_dim in HEAD_DIMS
        for rows in (4, 8)
        for rerun in ("false", "true")
    )
    return tensor_cores + simt + tuple(f"fastattn_gpu::decode_combine<{element}>" for element in _ELEMENTS.values())


def aligned(*arrays: Any) -> bool:
    """Whether every array starts on a 16-byte boundary (the kernel's cp.async copies need it)."""
    return all(_launch.address(array) % 16 == 0 for array in arrays)


def rows_per_block(problem: AttentionProblem) -> int:
    """Packed query rows per block (bigger packs are chunked): 16 on tensor cores (one m16 fragment);
    float32: 4 when the group's rows fit, else 8."""
    if problem.dtype != "float32":
        return TENSOR_CORE_ROWS
    return 4 if problem.group_size * problem.seq_q <= 4 else 8


def block_keys(dtype: str, head_dim: int, rows: int) -> int:
    """Keys per shared-memory tile (mirrors the kernels): tensor cores 256 at head_dim 32, 128 at 64,
    else 64 (64, 32 or 16 keys a warp); float32 WARPS * 32 / lanes, with the lanes of a key splitting
    head_dim 1 way (2 at 8 rows) at head_dim 32, 2 ways at 64, 4 ways above: 128 or 64, 64, 32."""
    if dtype != "float32":
        return 256 if head_dim <= 32 else 128 if head_dim <= 64 else 64
    lanes = rows // 4 if head_dim <= 32 else 2 if head_dim <= 64 else 4
    return WARPS * 32 // lanes


def shared_bytes(dtype: str, head_dim: int, rows: int) -> int:
    """Dynamic shared memory: the queries, for float32 each warp's P and rescale factors of a tile,
    then the K/V stages (the warps' merge reuses them)."""
    itemsize, keys = _ITEMSIZE[dtype], block_keys(dtype, head_dim, rows)
    vector = 16 // itemsize
    tiles = 4 * keys * (head_dim + vector) * itemsize
    if dtype != "float32":
        return rows * (head_dim + vector) * itemsize + tiles
    return 4 * (rows * head_dim + keys * rows + WARPS * rows) + tiles


def problem_shared_bytes(problem: AttentionProblem) -> int:
    """:func:`shared_bytes` of ``problem`` (the kernel table's form)."""
    return shared_bytes(problem.dtype, problem.head_dim, rows_per_block(problem))


def plan(problem: AttentionProblem, multiprocessors: int) -> tuple[int, int]:
    """Return ``(splits, keys_per_split)`` for a decode problem (see the module docstring)."""
    rows = rows_per_block(problem)
    items = problem.batch * problem.heads_kv * math.ceil(problem.group_size * problem.seq_q / rows)
    wanted = min(math.ceil(BLOCKS_PER_SM * multiprocessors / items), math.ceil(problem.seq_k / MIN_KEYS_PER_SPLIT))
    tile = block_keys(problem.dtype, problem.head_dim, rows)
    per_split = math.ceil(math.ceil(problem.seq_k / max(1, wanted)) / tile) * tile
    return math.ceil(problem.seq_k / per_split), per_split


def forward(problem: AttentionProblem, q: Any, k: Any, v: Any, out: Any, lse: Any, extras: AttentionExtras) -> None:
    """Launch the decode on (B, H, S, D)-ordered CuPy arrays, writing ``out`` and ``lse``.

    Parameters
    ----------
    q, k, v : cupy.ndarray
        ``(B, Hq, Sq, D)``, ``(B, Hkv, Sk, D)``, ``(B, Hkv, Sk, D)`` in the problem's dtype.
    out : cupy.ndarray
        ``(B, Hq, Sq, D)``, q's dtype, written.
    lse : cupy.ndarray
        ``(B, Hq, Sq)`` float32 with a contiguous last axis, written (natural log).
    """
    xp = _launch.array_module()
    rows = rows_per_block(problem)
    splits, per_split = plan(problem, _launch.multiprocessors())
    record = params.from_problem(problem, extras)
    for name, array in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        params.set_operand(record, name, array)
    record["keys_per_split"] = per_split
    query_rows = problem.batch * problem.heads_q * problem.seq_q
    shared = shared_bytes(problem.dtype, problem.head_dim, rows)
    chunks = math.ceil(problem.group_size * problem.seq_q / rows)
    names = _instances(problem, splits)
    with _launch.stream(problem.framework):
        # The partials stay referenced until the launches are made (on the emulator, until they ran).
        partials = {}
        if splits > 1:
            partials["partial_out"] = xp.empty((splits, query_rows, problem.head_dim), xp.float32)
            partials["partial_lse"] = xp.empty((splits, query_rows), xp.float32)
        for name, array in partials.items():
            params.set_pointer(record, name, array)
        argument = params.argument(record)
        decodes = names[:-1] if splits > 1 else names
        for name in decodes:
            _launch.compiled(SOURCE, name, shared)(
                (splits, problem.heads_kv * chunks, problem.batch), (THREADS,), argument, shared_mem=shared
            )
        if splits > 1:
            _launch.compiled(SOURCE, names[-1], 0)((query_rows,), (THREADS,), argument)
