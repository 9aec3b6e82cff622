#!/usr/bin/env bash
# compute-sanitizer over every cuda kernel (tensor-core forward and backward, issue #12; decode and
# float32, issue #13): memcheck (out-of-bounds and misaligned accesses, leaks) and racecheck
# (shared-memory hazards) on benchmarks/sanitize_cases.py.  Needs a CUDA device; writes
# benchmarks/results/sanitize-gpu-<date>.txt with each tool's ERROR SUMMARY and the full logs next to it.
set -euo pipefail
cd "$(dirname "$0")/.."
date="$(date +%F)"
results="benchmarks/results"
summary="$results/sanitize-gpu-$date.txt"
mkdir -p "$results"
: >"$summary"
status=0
for tool in memcheck racecheck; do
    log="$results/sanitize-gpu-$date-$tool.log"
    extra=()
    if [ "$tool" = memcheck ]; then extra=(--leak-check full); fi
    echo "+ compute-sanitizer --tool $tool ${extra[*]} python benchmarks/sanitize_cases.py" | tee -a "$summary"
    compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 99 "${PYTHON:-python3}" benchmarks/sanitize_cases.py >"$log" 2>&1 || status=$?
    grep -E "^[a-z0-9-]+: ok$|ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tee -a "$summary" || true
done
echo "exit status: $status" | tee -a "$summary"
exit "$status"
