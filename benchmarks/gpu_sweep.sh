#!/usr/bin/env bash
# GPU tests on a CUDA machine, spread over pytest-xdist workers: by default the declaration
# sweep (tests/backends/test_declarations.py), or any selection of test files in TESTS.
#
#   bash benchmarks/gpu_sweep.sh "<pytest -k expression>" [pytest arguments...]
#   TESTS="tests/backends/test_flashinfer.py tests/engine/test_cuda_graphs.py" \
#       bash benchmarks/gpu_sweep.sh "" [pytest arguments...]
#
# Only tests marked `gpu` run. LOG_NAME names the log under $OUT. WORKERS (default 12) sets the
# xdist workers and MAX_JOBS (default 4) FlashInfer's ninja jobs per JIT compile (FlashInfer's
# conformance kits compile many modules: 4 workers of 4 jobs each finish more of them than 16
# workers); SECONDS_LIMIT (default 520) cuts the run so that its log still comes back.
# FlashInfer and FlashAttention-4 are used when importable (staged wheels in .gpu-wheels/ are
# unpacked to /tmp/gpusite first by benchmarks/unpack_wheels.py, as far as their parts have
# arrived). The log lists every test with its outcome; the last lines printed are the counts and
# the failures.
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -d .gpu-wheels ]; then
    python3 benchmarks/unpack_wheels.py || exit 1
fi
# (paths already on PYTHONPATH come first: another build of a library can be tried that way)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:/tmp/gpusite:/tmp/gpusite/nvidia_cutlass_dsl/dsl_packages
export MAX_JOBS=${MAX_JOBS:-4}
expr=${1:-}
log="$out/${LOG_NAME:-sweep_$(date +%H%M%S)}.log"
timeout -s INT "${SECONDS_LIMIT:-520}" python3 -m pytest -m gpu -n "${WORKERS:-12}" \
    -p no:warnings -p no:benchmark --tb=line -rfE -v ${TESTS:-tests/backends/test_declarations.py} \
    -k "$expr" "${@:2}" >"$log" 2>&1
echo "pytest rc $? ($expr)"
echo "passed: $(grep -c " PASSED " "$log")  failed: $(grep -c " FAILED " "$log")  skipped: $(grep -c " SKIPPED " "$log")"
grep -E "^(FAILED|ERROR) " "$log" | cut -c1-400 | head -60
tail -2 "$log"
