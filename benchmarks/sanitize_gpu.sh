#!/usr/bin/env bash
# compute-sanitizer over every cuda kernel (tensor-core forward and backward, issue #12; decode and
# float32, issue #13): memcheck (out-of-bounds and misaligned accesses) and racecheck (shared-memory
# hazards) on benchmarks/sanitize_cases.py.  Leaks: before them, without a sanitizer, the cases run
# twice and the device memory in use after each pass is compared (under memcheck these cases' memory
# is never given back, so its --leak-check reports all of it: see sanitize_cases.py).  Needs a CUDA
# device; writes
# sanitize-gpu-<date>.txt with each step's summary and the full logs next to it, in
# $SANITIZE_OUT (default benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
date="$(date +%F)"
results="${SANITIZE_OUT:-benchmarks/results}"
python="${PYTHON:-python3}"
summary="$results/sanitize-gpu-$date.txt"
mkdir -p "$results"
: >"$summary"
status=0
echo "+ python benchmarks/sanitize_cases.py --passes 2" | tee -a "$summary"
"$python" benchmarks/sanitize_cases.py --passes 2 >"$results/sanitize-gpu-$date-kept-memory.log" 2>&1 || status=$?
grep -E "device memory|kept memory" "$results/sanitize-gpu-$date-kept-memory.log" | tee -a "$summary" || true
for tool in memcheck racecheck; do
    log="$results/sanitize-gpu-$date-$tool.log"
    echo "+ compute-sanitizer --tool $tool python benchmarks/sanitize_cases.py" | tee -a "$summary"
    compute-sanitizer --tool "$tool" --error-exitcode 99 "$python" benchmarks/sanitize_cases.py >"$log" 2>&1 || status=$?
    grep -E "^[a-z0-9-]+: ok$|ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tee -a "$summary" || true
done
echo "exit status: $status" | tee -a "$summary"
exit "$status"
