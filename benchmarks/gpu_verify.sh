#!/usr/bin/env bash
# Every GPU test of the repository on one CUDA machine, in two commands of at most 10 minutes
# each (FlashInfer's JIT compilation dominates; its cache in ~/.cache/flashinfer carries over
# from the first command to the second while the machine stays up):
#
#   bash benchmarks/gpu_verify.sh 1   FlashInfer's tests (declaration sweep, kit, XQA, CUDA-graph
#                                     replay) beside every test that needs neither FlashInfer
#                                     nor FlashAttention-4 (the other backends' declaration
#                                     sweeps, ops, engine, validation)
#   bash benchmarks/gpu_verify.sh 2   FlashAttention-4, FLASHINFER_MLA, per-phase pairs and
#                                     measured selection, beside FlashInfer's tests again (those
#                                     compiled by command 1 now run at once; the rest compile)
#
# Staged wheels (benchmarks/pack_wheels.py) are unpacked first; with the bundles packed
# FlashInfer first, the first transfer brings FlashInfer and the second completes FA4. Logs and
# summaries go to $OUT (default /tmp/out): fi.log, rest.log, fa4.log and *.sum. Time limits in
# seconds: FI_S (550) and REST_S (540); workers FI_W (6, MAX_JOBS 3 each) and REST_W (6).
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
part=${1:?usage: gpu_verify.sh 1|2}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -d .gpu-wheels ]; then
    python3 benchmarks/unpack_wheels.py || exit 1
fi
sweep="bash benchmarks/gpu_sweep.sh"
fi_tests="tests/backends/test_declarations.py tests/backends/test_flashinfer.py
    tests/backends/test_flashinfer_xqa.py tests/engine/test_cuda_graphs.py"
(TESTS="$fi_tests" WORKERS=${FI_W:-6} MAX_JOBS=3 SECONDS_LIMIT=${FI_S:-550} LOG_NAME=fi$part \
    $sweep "(FLASHINFER or flashinfer) and not MLA and not mla and not cascade" \
    >"$out/fi$part.sum" 2>&1) &
if [ "$part" = 1 ]; then
    TESTS="tests/backends tests/engine tests/ops tests/testing tests/test_*.py" \
    WORKERS=${REST_W:-6} SECONDS_LIMIT=${REST_S:-540} LOG_NAME=rest $sweep \
        "not FLASHINFER and not flashinfer and not FLASH_ATTN and not flash_attn and not per_phase and not cascade and not fastest"
else
    TESTS="tests/backends tests/engine tests/test_*.py" WORKERS=${REST_W:-6} MAX_JOBS=3 \
    SECONDS_LIMIT=${REST_S:-540} LOG_NAME=fa4 $sweep \
        "FLASH_ATTN or flash_attn or per_phase or cascade or FLASHINFER_MLA or flashinfer_mla or fastest"
fi
wait
echo "== FlashInfer"
cat "$out/fi$part.sum"
