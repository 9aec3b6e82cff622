"""The ``cpu`` backend: Cython + OpenMP flash attention on numpy arrays, forward and backward.

The kernels live in ``fastattn._cpu._flash``: see ``fastattn/_cpu/flash_forward.h`` (forward),
``flash_decode.h`` (the decode path, Sq <= 16 with split keys) and ``flash_backward.h`` for the
algorithms and tile sizes.  Every contract feature is handled inside the kernels.  They are built
for several instruction-set levels; ``fastattn._cpu.isa`` says which runs (``FASTATTN_ISA``).
"""

from __future__ import annotations

import math
from typing import Any

from .. import _threads
from .._cpu import _flash, _runtime, isa
from .._problem import AttentionExtras, AttentionProblem

#: Query rows (all heads of a GQA group together) per work item; keys per tile.
TILE_ROWS = 64
KEY_TILE = 128
#: The AMX bfloat16 and float16 forward (fastattn/_cpu/flash_amx.h) packs Q once per item and P once per
#: key tile: larger tiles spread that over more tile products (10-15% faster on a 2-core Xeon).  The
#: AMX backward (flash_backward_bf16.h) takes the same sizes: its dK/dV tiles are loaded and stored
#: once per query tile and K^T packed once per key tile (C1 4.9 -> 4.1-4.5 ms, C5 80 -> 72 there).
AMX_TILE_ROWS = 128
AMX_KEY_TILE = 256
#: At most this many query positions take the decode path (one tile, keys split across threads).
DECODE_MAX_QUERIES = 16
#: Keys per tile of a decode item over a group of kv heads (``decode_head_group``): while each head
#: computes, its share of the next tile's token rows (every head's bytes) is prefetched as one run;
#: 64 keys keep that run within L2 (float16, 8 kv heads, D=128: 256 KiB).  (8, 4096, 8, 128)
#: float16 token-major decode on a 2-core Zen 5: 3.8-3.9 ms with 128 keys, 3.35-3.4 ms with 64
#: (head-major arrays: 3.0-3.2 ms).
HEAD_GROUP_KEY_TILE = 64


def build_summary() -> str:
    """Return e.g. ``"avx512, OpenMP 201511, 2 threads"`` or ``"generic, serial build (no OpenMP), 1 thread"``."""
    threads = _threads.get_num_threads()
    plural = "thread" if threads == 1 else "threads"
    if _runtime.openmp_enabled():
        return f"{isa.active()}, OpenMP {_runtime.openmp_version()}, {threads} {plural}"
    return f"{isa.active()}, serial build (no OpenMP), {threads} {plural}"


def tile_sizes(problem: AttentionProblem, threads: int) -> tuple[int, int]:
    """Return ``(tile_rows, key_tile)`` of the forward: ``AMX_TILE_ROWS``/``AMX_KEY_TILE`` where the
    kernels would run those items on AMX (they say so: ``_flash.forward_kernel``, the rule the
    kernels apply) and the larger row blocks still give every thread four items;
    ``HEAD_GROUP_KEY_TILE`` keys for a decode over groups of kv heads; else ``TILE_ROWS``/``KEY_TILE``."""
    positions = max(1, AMX_TILE_ROWS // problem.group_size)
    enough_items = problem.batch * problem.heads_kv * math.ceil(problem.seq_q / positions) >= 4 * threads
    if enough_items and _flash.forward_kernel(problem, positions, AMX_KEY_TILE) == "amx":
        return AMX_TILE_ROWS, AMX_KEY_TILE
    if decode_head_group(problem, KEY_TILE) > 1:
        return TILE_ROWS, HEAD_GROUP_KEY_TILE
    return TILE_ROWS, KEY_TILE


#: The most kv heads one decode item takes (``kMaxHeadGroup`` in fastattn/_cpu/params.h).
MAX_HEAD_GROUP = 64


def decode_head_group(problem: AttentionProblem, key_tile: int) -> int:
    """Kv heads per decode item: all of them (up to ``MAX_HEAD_GROUP``) where K and V lie
    token-major (a kv head's consecutive tokens further apart than its neighbour heads: a
    ``(B, S, H, D)`` array) and a decode kernel with per-head steps runs the item (float32 vectors
    or `vdpbf16ps`): it then sweeps each key tile's token rows, every head's bytes together
    (``forward_heads`` in fastattn/_cpu/forward_items.h); else 1 (head-major memory, such as a
    ``KVCache``'s, streams each head's tokens as one run already)."""
    token_major = problem.k_strides[1] < problem.k_strides[2] and problem.v_strides[1] < problem.v_strides[2]
    if problem.seq_q > DECODE_MAX_QUERIES or not token_major or not 1 < problem.heads_kv <= MAX_HEAD_GROUP:
        return 1
    kernel = _flash.forward_kernel(problem, problem.seq_q, key_tile)
    return problem.heads_kv if kernel in ("vector-decode", "dpbf16-decode") else 1


def plan(problem: AttentionProblem, threads: int) -> tuple[int, int]:
    """Return ``(block_queries, splits)``: query positions per work item and key splits.

    A GQA group's rows are stacked, so a block holds ``tile_rows // group`` positions.  Decode
    (``Sq <= DECODE_MAX_QUERIES``) keeps all query rows in one tile and, when there are fewer
    (batch, group of kv heads: ``decode_head_group``) items than twice the threads, splits the
    keys so every thread has work.
    """
    tile_rows, key_tile = tile_sizes(problem, threads)
    if problem.seq_q <= DECODE_MAX_QUERIES:
        items = problem.batch * (problem.heads_kv // decode_head_group(problem, key_tile))
        if items >= 2 * threads:
            return problem.seq_q, 1
        tiles = math.ceil(problem.seq_k / key_tile)
        return problem.seq_q, max(1, min(tiles, math.ceil(2 * threads / items)))
    return max(1, tile_rows // problem.group_size), 1


#: Below this many multiply-adds a call runs on the calling thread alone: waking the OpenMP team
#: costs more than the work (tens of microseconds with passive waiting).
SINGLE_THREAD_WORK = 1 << 20


def _threads_for(problem: AttentionProblem, threads: int) -> int:
    """The calling thread alone for small problems, else the configured count."""
    work = problem.batch * problem.heads_q * problem.seq_q * problem.seq_k * (problem.head_dim + problem.head_dim_v)
    return 1 if work < SINGLE_THREAD_WORK else threads


#: How many plans each direction keeps before it starts afresh.
PLANS_KEPT = 256
_forward_plans: dict[tuple[int, int, str], tuple[AttentionProblem, _flash.ForwardPlan]] = {}


def forward_plan(problem: AttentionProblem, threads: int) -> _flash.ForwardPlan:
    """The forward kernel's parameters for ``problem`` with ``threads`` configured, built once.

    Kept by the problem's identity (validation hands out one object per distinct problem), as the
    registry keeps its selections: an equal problem of another identity only builds its own plan.
    A plan runs the instruction-set level active when it was built, so the level is in the key.
    """
    key = (id(problem), threads, isa.active())
    kept = _forward_plans.get(key)
    if kept is not None and kept[0] is problem:
        return kept[1]
    used = _threads_for(problem, threads)
    block_queries, splits = plan(problem, used)
    key_tile = tile_sizes(problem, used)[1]
    built = _flash.ForwardPlan(problem, block_queries, key_tile, splits, used, decode_head_group(problem, key_tile))
    if len(_forward_plans) >= PLANS_KEPT:
        _forward_plans.clear()
    _forward_plans[key] = (problem, built)
    return built


#: The backward's gradient pass runs one item per (batch, kv head, chunk of key blocks), each chunk
#: summing its own dQ partial: at least this many items where the key blocks allow, so that the
#: threads of a large machine have work, ...
BACKWARD_ITEMS = 32
#: ... while the partials (chunks x dQ in the compute type) stay within this many bytes.
BACKWARD_PARTIAL_BYTES = 256 << 20


def backward_tile_sizes(problem: AttentionProblem) -> tuple[int, int]:
    """Return ``(tile_rows, key_tile)`` of the backward: ``AMX_TILE_ROWS``/``AMX_KEY_TILE`` where the
    kernels run the gradient pass on AMX tiles (``_flash.backward_kernel``), else
    ``TILE_ROWS``/``KEY_TILE``.  From the problem and the active level alone, as the chunks are."""
    if _flash.backward_kernel(problem, max(1, AMX_TILE_ROWS // problem.group_size), AMX_KEY_TILE) == "amx":
        return AMX_TILE_ROWS, AMX_KEY_TILE
    return TILE_ROWS, KEY_TILE


def backward_chunks(problem: AttentionProblem, key_tile: int = KEY_TILE) -> int:
    """Chunks of key blocks of ``key_tile`` keys per kv head in the backward (see
    ``fastattn/_cpu/flash_backward.h``).

    Chosen from the problem alone, never from the thread count: the chunks fix the order in which
    dQ's partial sums are added, so the gradients are bit-identical at any thread count.
    """
    key_blocks = max(1, math.ceil(problem.seq_k / key_tile))
    chunks = min(key_blocks, math.ceil(BACKWARD_ITEMS / (problem.batch * problem.heads_kv)))
    element_bytes = 8 if problem.dtype == "float64" else 4
    dq_bytes = problem.batch * problem.heads_q * problem.seq_q * problem.head_dim * element_bytes
    while chunks > 1 and chunks * dq_bytes > BACKWARD_PARTIAL_BYTES:
        chunks -= 1
    return chunks


_backward_plans: dict[tuple[int, int, str], tuple[AttentionProblem, _flash.BackwardPlan]] = {}


def backward_plan(problem: AttentionProblem, threads: int) -> _flash.BackwardPlan:
    """The backward kernels' parameters for ``problem`` with ``threads`` configured, built once
    (kept like :func:`forward_plan`'s)."""
    key = (id(problem), threads, isa.active())
    kept = _backward_plans.get(key)
    if kept is not None and kept[0] is problem:
        return kept[1]
    tile_rows, key_tile = backward_tile_sizes(problem)
    block_queries = max(1, tile_rows // problem.group_size)
    chunks = backward_chunks(problem, key_tile)
    built = _flash.BackwardPlan(problem, block_queries, key_tile, chunks, _threads_for(problem, threads))
    if len(_backward_plans) >= PLANS_KEPT:
        _backward_plans.clear()
    _backward_plans[key] = (problem, built)
    return built


class CpuBackend:
    """Cython/OpenMP kernels on numpy arrays (host memory)."""

    name = "cpu"
    devices: tuple[str, ...] = ("cpu",)
    priority = 20

    @property
    def description(self) -> str:
        """The build line shown by ``fastattn.backends.available()``."""
        return f"Cython kernels, {build_summary()}"

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """Every valid problem on the host runs here (the registry checks the device)."""
        return []

    def forward(
        self, problem: AttentionProblem, q: Any, k: Any, v: Any, extras: AttentionExtras
    ) -> tuple[Any, Any]:
        """Return ``(out, lse)`` computed by the flash kernel."""
        return forward_plan(problem, _threads.get_num_threads()).run(q, k, v, extras)

    def backward(
        self,
        problem: AttentionProblem,
        dout: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        extras: AttentionExtras,
    ) -> tuple[Any, Any, Any]:
        """Return ``(dq, dk, dv)`` computed by the flash backward (deterministic at any thread count)."""
        return backward_plan(problem, _threads.get_num_threads()).run(dout, q, k, v, out, lse, extras)
