#!/usr/bin/env bash
# What a GPU session runs first (issue #19); steps run in the order given, e.g.
#   benchmarks/gpu_check.sh install compile tests bench emulated sanitize ncu
# Everything a step prints and writes lands in benchmarks/results/gpu-check-<date>/ (commit it), or in
# $GPU_CHECK_OUT where set (a second session on the same date, another card).
#   install    pip install --no-build-isolation --no-deps -e . (the device image has the dependencies
#              but array-api-compat: carry its wheel, see /work/.library/device/README.md)
#   compile    every kernel instance through NVRTC on all cores (gpu_compile_all.py): fills CuPy's
#              kernel cache for the later steps; registers and spills per instance
#   tests      the GPU tests and the conformance suite on cuda ($GPU_TESTS_ARGS are passed on to pytest,
#              e.g. GPU_TESTS_ARGS="-n 8" with pytest-xdist)
#   emulated   the cuda backend against cuda-emulated on the same inputs (gpu_emulated_vs_real.py)
#   sanitize   compute-sanitizer memcheck and racecheck (sanitize_gpu.sh)
#   bench      bench_gpu.py: forward, forward+backward, decode, float32, torch ($BENCH_GPU_ARGS are
#              passed on, e.g. BENCH_GPU_ARGS="--repeats 10 --profile-calls 5")
#   ncu        Nsight Compute's full set over fastattn's tensor-core kernels and torch's FlashAttention-2
#              kernels, one call each (ncu_kernels.py, G4 bfloat16; $NCU_PASSES: forward backward): each
#              pass's details page and ncu_summary.py's digest of its SASS page; the reports and the
#              SASS pages themselves (tens of MB) go to raw/, which git ignores
# A step that fails is reported and the next one still runs; the exit status is the last failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
out="${GPU_CHECK_OUT:-benchmarks/results/gpu-check-$(date +%F)}"
mkdir -p "$out"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
if [ "$#" -eq 0 ]; then
    echo "usage: benchmarks/gpu_check.sh {install|compile|tests|emulated|sanitize|bench|ncu}..." >&2
    exit 2
fi
status=0
for step in "$@"; do
    started=$(date +%s)
    case "$step" in
        install)
            "$python" -m pip install --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1
            ;;
        compile)
            "$python" benchmarks/gpu_compile_all.py --json "$out/compile.json" 2>&1 | tee "$out/compile.log"
            ;;
        tests)
            "$python" -m pytest -q -p no:cacheprovider --durations=20 ${GPU_TESTS_ARGS:-} tests/test_cuda_backend.py \
                tests/test_cuda_decode.py tests/test_cuda_fp32.py tests/nn/test_cuda.py tests/test_torch_adapter.py \
                tests/conformance -k "cuda and not emulated" 2>&1 | tee "$out/tests.log"
            ;;
        emulated)
            "$python" benchmarks/gpu_emulated_vs_real.py 2>&1 | tee "$out/emulated-vs-real.log"
            ;;
        sanitize)
            PYTHON="$python" SANITIZE_OUT="$out" bash benchmarks/sanitize_gpu.sh 2>&1 | tee "$out/sanitize.log"
            ;;
        bench)
            "$python" benchmarks/bench_gpu.py --json "$out/bench-gpu.json" ${BENCH_GPU_ARGS:-} 2>&1 | tee "$out/bench.log"
            ;;
        ncu)
            mkdir -p "$out/raw"
            failed=0
            for pass in ${NCU_PASSES:-forward backward}; do
                report="$out/raw/ncu-$pass"
                ncu --set full -k "$("$python" benchmarks/ncu_kernels.py --pass "$pass" --print-kernels)" -f -o "$report" \
                    "$python" benchmarks/ncu_kernels.py --pass "$pass" >"$out/ncu-$pass.log" 2>&1 &&
                    ncu -i "$report.ncu-rep" --page details >"$out/ncu-$pass-details.txt" 2>&1 &&
                    ncu -i "$report.ncu-rep" --page source --print-source sass >"$report-sass.txt" 2>&1 &&
                    "$python" benchmarks/ncu_summary.py "$report-sass.txt" >"$out/ncu-$pass-summary.txt" || failed=1
            done
            [ "$failed" -eq 0 ]
            ;;
        *)
            echo "unknown step $step: expected install, compile, tests, emulated, sanitize, bench or ncu" >&2
            false
            ;;
    esac
    result=$?
    echo "gpu_check: $step exit $result after $(( $(date +%s) - started )) s" | tee -a "$out/steps.log"
    [ "$result" -eq 0 ] || status=$result
done
exit "$status"
