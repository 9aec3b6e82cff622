"""Plant known kernel bugs one at a time and check that the emulated kernel tests catch each.

Not part of the default test run (its name does not start with ``test_``); replay it after every
kernel change, from the repository root:

    python -m tests.emulator.planted_bugs            # exit status 1 if any bug goes unnoticed

Each bug is a text replacement in one kernel source (or a header every source includes), applied
to the text the emulator compiles (``_launch.source_text``): the files are never modified.  A bug
counts as caught when at least one case of ``test_kernels.py``, ``test_dropout.py`` or ``test_decode.py`` fails on
it (a wrong result or an emulator error) while all pass without it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

from fastattn._gpu import _launch, emulator

from . import test_decode, test_dropout, test_kernels


class Bug(NamedTuple):
    """A replacement of ``old`` (which must occur in the source's text) by ``new``."""

    name: str
    source: str
    old: str
    new: str


BUGS = [
    Bug(
        "tensor-core forward and decode: P's A fragment with its two elements swapped (a wrong lane mapping)",
        "flash_forward.cu",
        "probs[nb / 2][(nb % 2) * 2 + 0] = Pack<Elem>::two(prob[0], prob[1]);",
        "probs[nb / 2][(nb % 2) * 2 + 0] = Pack<Elem>::two(prob[1], prob[0]);",
    ),
    Bug(
        "tensor-core forward: no __syncthreads before a stage is overwritten by the next prefetch",
        "flash_forward.cu",
        "        __syncthreads();  // this stage is overwritten by the prefetch of the tile after next\n    };",
        "    };",
    ),
    Bug(
        "tensor-core forward and dQ: the K/V tile is read without waiting for its cp.async group",
        "flash_forward.cu",
        "        cp_async_commit();\n        cp_async_wait<1>();\n        __syncthreads();\n    }\n",
        "        cp_async_commit();\n        __syncthreads();\n    }\n",
    ),
    Bug(
        "every kernel: the causal key range one key short (off by one)",
        "flash_forward.cu",
        "if (causal) high = min(high, last + offset + 1);",
        "if (causal) high = min(high, last + offset);",
    ),
    Bug(
        "float32 forward: query head h reads kv head h % group instead of h / group (GQA mapping)",
        "flash_fp32.cu",
        "const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z, kvh = h / p.group;\n    const int ty",
        "const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z, kvh = h % p.group;\n    const int ty",
    ),
    Bug(
        "decode combine: the last split left out of the denominator (a wrong split count)",
        "flash_decode.cu",
        "for (int s = 0; s < splits; ++s) total += flush_tiny(expf(p.partial_lse[s * rows + row] - top));",
        "for (int s = 0; s < splits - 1; ++s) total += flush_tiny(expf(p.partial_lse[s * rows + row] - top));",
    ),
    Bug(
        "decode: the warps' outputs merged without the correction to the block's row max",
        "flash_decode.cu",
        "weight[w * ROWS + row] = total > 0.f ? fast_exp2(row_max[w * ROWS + row] - shift) / total : 0.f;",
        "weight[w * ROWS + row] = total > 0.f ? 1.f / total : 0.f;",
    ),
    Bug(
        "tensor-core decode: every warp's scores read the first warp's keys of the tile",
        "flash_decode.cu",
        "warp_product_nt<Elem, HEAD_DIM, kKeyBlocks>(s, q_tile, stream.k_tile(stage) + warp * kWarpKeys * kRow, kRow,",
        "warp_product_nt<Elem, HEAD_DIM, kKeyBlocks>(s, q_tile, stream.k_tile(stage), kRow,",
    ),
    Bug(
        "tensor-core decode: a lane's second row (m16 row + 8) takes the first row's head and position",
        "flash_decode.cu",
        "const int packed = row0 + group_id + 8 * r;\n        const bool real = group_id + 8 * r < packed_rows;",
        "const int packed = row0 + group_id;\n        const bool real = group_id < packed_rows;",
    ),
    Bug(
        "float32 decode: the reduce-scatter of a key's partial dot products keeps the other half of the rows",
        "flash_decode.cu",
        "const bool upper = (part & step) != 0;",
        "const bool upper = (part & step) == 0;",
    ),
    Bug(
        "float32 decode: a rescaling tile moves the row maximum but not the shift of its probabilities",
        "flash_decode.cu",
        "shift[i] = none ? 0.f : new_max;",
        "shift[i] = none ? 0.f : shift[i];",
    ),
    Bug(
        "float32 decode: no exact redo of a tile whose plain FMAs made a NaN (0 x inf at a hidden key)",
        "flash_decode.cu",
        "if (__any_sync(0xffffffff, probe != probe)) return false;",
        "if (__any_sync(0xffffffff, false)) return false;",
    ),
    Bug(
        "float32 decode: the warp's P read before every lane wrote it (no __syncwarp)",
        "flash_decode.cu",
        "store_floats(warp_p + key * ROWS + part * kLaneRows, prob);\n        __syncwarp();\n        if (!update",
        "store_floats(warp_p + key * ROWS + part * kLaneRows, prob);\n        if (!update",
    ),
    Bug(
        "tensor-core forward and decode: no exact rerun when a block's output came out NaN (0 x inf on mma.sync)",
        "mma_tiles.cuh",
        "if (__syncthreads_or(probe != probe)) {",
        "if (__syncthreads_or(false)) {",
    ),
    Bug(
        "tensor-core exact product: row g + 8's weights read from row g's register",
        "mma_tiles.cuh",
        "Pack<Elem>::element(__shfl_sync(0xffffffff, a[ks][reg + 1], owner), k8 % 2);",
        "Pack<Elem>::element(__shfl_sync(0xffffffff, a[ks][reg], owner), k8 % 2);",
    ),
    Bug(
        "tensor-core backward: dS^T read before every warp has written it (no __syncthreads)",
        "flash_backward.cu",
        "Pack<Elem>::two(dp[nb][2 * r], dp[nb][2 * r + 1]);\n            }\n        }\n        __syncthreads();\n",
        "Pack<Elem>::two(dp[nb][2 * r], dp[nb][2 * r + 1]);\n            }\n        }\n",
    ),
    Bug(
        "float32 backward dK/dV: no __syncthreads before the K/V tiles are reused",
        "flash_fp32.cu",
        "__syncthreads();  // the previous step is done with k_s, v_s, ds_s\n",
        "\n",
    ),
    Bug(
        "tensor-core forward: the interior (unmasked) tiles run one tile past the last whole visible one",
        "flash_forward.cu",
        "const int tile_hi = lo + max(min(common_hi, hi) - lo, 0) / BLOCK_N * BLOCK_N;",
        "const int tile_hi = lo + max(min(common_hi, hi) - lo, 0) / BLOCK_N * BLOCK_N + BLOCK_N;",
    ),
    Bug(
        "tensor-core forward: the interior tiles start at a tile the window's left edge cuts",
        "flash_forward.cu",
        "const int tile_lo = lo + (max(common_lo - lo, 0) + BLOCK_N - 1) / BLOCK_N * BLOCK_N;",
        "const int tile_lo = lo + max(common_lo - lo, 0) / BLOCK_N * BLOCK_N;",
    ),
    Bug(
        "tensor-core backward dK/dV: a head's interior query tiles counted from the group's first head",
        "flash_backward.cu",
        "for (; item < first + interior_lo; ++item, stage ^= 1) step(Flag<true>{}, item, stage);",
        "for (; item < interior_lo; ++item, stage ^= 1) step(Flag<true>{}, item, stage);",
    ),
    Bug(
        "tensor-core backward dK/dV: the interior query tiles run one tile past the rows that see every key",
        "flash_backward.cu",
        "const int tile_hi = min(max(common_hi - m_lo, 0) / BLOCK_M, tiles);",
        "const int tile_hi = min(max(common_hi - m_lo, 0) / BLOCK_M + 1, tiles);",
    ),
    Bug(
        "tensor-core backward: an interior tile's dS without the softcap slope",
        "flash_backward.cu",
        "*prob = fast_exp2(rule.softcapped_log2_score(dot, &slope) - lse2);",
        "*prob = fast_exp2(rule.softcapped_log2_score(dot) - lse2);",
    ),
    Bug(
        "dropout, tensor-core forward and dQ: the words of keys 0-1 of a Philox block used for keys 2-3",
        "flash_forward.cu",
        "const bool high = (j & 2) != 0;",
        "const bool high = false;",
    ),
    Bug(
        "dropout, tensor-core backward: P^T enters dV without the dropout multipliers",
        "flash_backward.cu",
        "s[nb][e] = prob * factor;",
        "s[nb][e] = prob;",
    ),
    Bug(
        "dropout, float32 kernels and tensor-core dK/dV: query and key block swapped in the Philox counter",
        "flash_fp32.cu",
        "static_cast<unsigned int>(i), static_cast<unsigned int>(j) >> 2, words);\n        const unsigned int low",
        "static_cast<unsigned int>(j) >> 2, static_cast<unsigned int>(i), words);\n        const unsigned int low",
    ),
]


def _cases() -> list[Callable[[], None]]:
    """Every case of test_kernels.py, test_dropout.py and test_decode.py, as a call."""
    calls: list[Callable[[], None]] = []
    for dtype, sizes, options in test_kernels.FORWARDS:
        calls.append(lambda c=(dtype, sizes, options): test_kernels.test_forward_kernels_match_the_reference(*c))
    for dtype, sizes, options in test_kernels.NONFINITE_FORWARDS:
        calls.append(lambda c=(dtype, sizes, options): test_kernels.check_nonfinite_forward(*c))
    for dtype, sizes, options, deterministic in test_kernels.BACKWARDS:
        arguments = (dtype, sizes, options, deterministic)
        calls.append(lambda c=arguments: test_kernels.test_backward_kernels_match_the_reference(*c))
    for dtype in test_dropout.DTYPES:
        for options in test_dropout.OPTIONS:
            arguments = (dtype, 70, options)
            calls.append(lambda c=arguments: test_dropout.test_forward_mask_is_the_cpus_element_by_element(*c))
    for dtype, deterministic, options in test_dropout.BACKWARDS:
        arguments = (dtype, deterministic, options)
        calls.append(lambda c=arguments: test_dropout.test_backward_matches_the_reference_under_the_same_mask(*c))
    for _, case, forced in test_decode.CASES:
        calls.append(lambda c=(case, forced): test_decode.check_emulated_decode(*c))
    for _, case in test_decode.NONFINITE_CASES:
        calls.append(lambda c=case: test_decode.check_nonfinite_decode(c))
    for _, case in test_decode.RISING_CASES:
        calls.append(lambda c=case: test_decode.check_rising_maximum(c))
    return calls


def _failures(calls: list[Callable[[], None]], first_only: bool = False) -> list[str]:
    """The calls that fail, as lines; with ``first_only``, up to the first (a planted bug is caught
    once one case fails)."""
    failed = []
    for index, call in enumerate(calls):
        try:
            call()
        except (AssertionError, emulator.EmulationError) as error:
            first_line = (str(error) or "a result beyond tolerance").splitlines()[0][:100]
            failed.append(f"case {index}: {type(error).__name__}: {first_line}")
            if first_only:
                break
    return failed


def main() -> int:
    original = _launch.source_text
    calls = _cases()
    _launch._emulated_kernel.cache_clear()
    clean = _failures(calls)
    if clean:
        print("the emulated kernel tests fail without any planted bug:", *clean, sep="\n  ")
        return 1
    missed = 0
    for bug in BUGS:
        if bug.old not in original(bug.source):
            print(f"STALE  {bug.name}: its text is no longer in {bug.source}")
            missed += 1
            continue

        def planted(name: str, bug: Bug = bug) -> str:
            text = original(name)
            return text.replace(bug.old, bug.new) if bug.old in text else text

        _launch.source_text = planted
        _launch._emulated_kernel.cache_clear()
        try:
            failed = _failures(calls, first_only=True)
        finally:
            _launch.source_text = original
        status = "caught" if failed else "MISSED"
        missed += not failed
        print(f"{status:6s} {bug.name}" + (f"\n         {failed[0]}" if failed else ""))
    _launch._emulated_kernel.cache_clear()
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
