#!/usr/bin/env bash
# What a GPU session runs first (issue #19), one step per call, each under 9 minutes on an H100;
# everything a step prints and writes lands in benchmarks/results/gpu-check-<date>/ (commit it).
#   benchmarks/gpu_check.sh tests      install; the GPU tests and the conformance suite on cuda; the
#                                      cuda backend against cuda-emulated on the same inputs
#   benchmarks/gpu_check.sh sanitize   compute-sanitizer memcheck and racecheck (sanitize_gpu.sh)
#   benchmarks/gpu_check.sh bench      bench_gpu.py: forward, forward+backward, decode, float32, torch
set -euo pipefail
cd "$(dirname "$0")/.."
step="${1:-}"
out="benchmarks/results/gpu-check-$(date +%F)"
mkdir -p "$out"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
case "$step" in
    tests)
        pip install --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1
        status=0
        python -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py tests/test_cuda_decode.py \
            tests/test_cuda_fp32.py tests/nn/test_cuda.py tests/test_torch_adapter.py \
            tests/conformance -k "cuda and not emulated" 2>&1 | tee "$out/tests.log" || status=$?
        python benchmarks/gpu_emulated_vs_real.py 2>&1 | tee "$out/emulated-vs-real.log" || status=$?
        exit "$status"
        ;;
    sanitize)
        bash benchmarks/sanitize_gpu.sh 2>&1 | tee "$out/sanitize.log"
        ;;
    bench)
        python benchmarks/bench_gpu.py --json "$out/bench-gpu.json" 2>&1 | tee "$out/bench.log"
        ;;
    *)
        echo "usage: benchmarks/gpu_check.sh {tests|sanitize|bench}" >&2
        exit 2
        ;;
esac
