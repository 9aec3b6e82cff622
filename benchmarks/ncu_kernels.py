"""fastattn's tensor-core kernels beside torch's FlashAttention-2 kernels, for Nsight Compute (gpu_check.sh's ncu step).

One call of each on the same bench_gpu.py case and inputs: the forward, or the forward and its
backward (autograd through ``fastattn.torch.attention``), so that

    ncu --set full -k regex:'flash_forward|flash_fwd' python benchmarks/ncu_kernels.py --pass forward
    ncu --set full -k regex:'flash_backward|flash_bwd' python benchmarks/ncu_kernels.py --pass backward

profile both implementations' kernels in one report (stall reasons, pipe use, shared-memory
wavefronts per kernel).  Nsight Compute flushes the caches and replays each kernel, so one call
needs no warm-up.  Needs a CUDA device and torch.
"""

from __future__ import annotations

import argparse

from bench_gpu import CASES, implementations, training_implementations  # benchmarks/ is on sys.path

#: The kernel names (regular expression for ``ncu -k``) that each pass profiles.
KERNELS = {"forward": "flash_forward|flash_fwd", "backward": "flash_backward|flash_bwd"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pass", dest="pass_", default="forward", choices=list(KERNELS))
    parser.add_argument("--case", default="G4", choices=[name for name in CASES if CASES[name][3] > 1])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--print-kernels", action="store_true", help="print the pass's ncu -k expression and exit")
    arguments = parser.parse_args(argv)
    if arguments.print_kernels:
        print(f"regex:{KERNELS[arguments.pass_]}")
        return 0
    import torch

    batch, heads_q, heads_kv, queries, keys, head_dim, causal = CASES[arguments.case]
    dtype = getattr(torch, arguments.dtype)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def normal(heads: int, rows: int) -> torch.Tensor:
        return torch.randn(batch, heads, rows, head_dim, device="cuda", dtype=dtype, generator=generator)

    q, k, v = normal(heads_q, queries), normal(heads_kv, keys), normal(heads_kv, keys)
    names = ("fastattn cuda", "torch flash")
    if arguments.pass_ == "forward":
        for name in names:
            implementations(torch)[name](q, k, v, causal)
    else:
        grad = normal(heads_q, queries)
        for tensor in (q, k, v):
            tensor.requires_grad_(True)
        for name in names:
            training_implementations(torch)[name](q, k, v, causal, grad)
    torch.cuda.synchronize()
    print(f"{arguments.case} {arguments.dtype} {arguments.pass_}: one call each of {', '.join(names)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
