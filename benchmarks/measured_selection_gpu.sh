#!/usr/bin/env bash
# Measured selection ("fastest") and per-phase pairs on a GPU machine, each step under a timeout
# so that its log comes back:
#   tests   the per-phase GPU test (a pair's decodes replay CUDA graphs; tokens equal TRITON's)
#   table   benchmarks/fastest.py: "fastest"'s pick against FLASH_ATTN, FLASHINFER, TRITON on
#           the five kernel cases, and `anyattn explain --measure` twice over one cache
#   engine  benchmarks/engine_gpu.py: the single backends, "fastest" and per-phase pairs on
#           batches 16 and 64 and on the mixed workload, CUDA graphs on
#
#   bash benchmarks/measured_selection_gpu.sh [tests] [table] [engine]    (default: all three)
#
# One command may run 10 minutes: run `tests table` (about 5 minutes) and `engine` (about 5
# minutes) as two commands. FlashInfer and FA4 must be importable: on PYTHONPATH already, or
# staged in .gpu-wheels/ (unpacked to /tmp/gpusite by benchmarks/unpack_wheels.py); src/ first.
# Writes under $OUT (default /tmp/out): tests.log, fastest.md (the tables), fastest.log,
# fastest.json, engine.log, engine_gpu.json, engine_gpu.png. Settings (environment):
# BACKENDS (default "TRITON FLASH_ATTN FLASHINFER"), PAIRS (default "TRITON,FLASH_ATTN
# FLASHINFER,FLASH_ATTN"), REPEATS (2, engine runs per contender), WORKLOADS (default "batch
# mixed", in the order run), and the timeouts in seconds TESTS_S (150), TABLE_S (420),
# ENGINE_S (560). Prints each step's exit status, time and tables.
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -d .gpu-wheels ]; then
    python3 benchmarks/unpack_wheels.py || exit 1
fi
if [ -d /tmp/gpusite ]; then
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/gpusite:/tmp/gpusite/nvidia_cutlass_dsl/dsl_packages
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# Measurements of this run only (the explain step uses a folder of its own).
ANYATTN_CACHE_DIR=$(mktemp -d)
export ANYATTN_CACHE_DIR
unset ANYATTN_NO_MEASURE_CACHE ANYATTN_BACKEND

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 - <<'EOF'
import torch
from anyattn.registry import get_backend_class
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
for name in ("TRITON", "FLASH_ATTN", "FLASHINFER"):
    print(f"{name}: {get_backend_class(name).get_unavailable_reason() or 'available'}")
EOF

# run NAME LIMIT COMMAND...: COMMAND under `timeout` (SIGINT first: the scripts then report what
# they finished, and are killed 30 s later if still running); the caller redirects its output,
# the exit line goes to this script's stdout (fd 3).
exec 3>&1
run() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout -s INT -k 30 "$limit" "$@"
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit s)" >&3
}

for step in ${*:-tests table engine}; do
    case $step in
    tests)
        run tests "${TESTS_S:-150}" python3 -m pytest -m gpu -p no:cacheprovider -p no:warnings \
            -v -rfEs tests/engine/test_per_phase_gpu.py >"$out/tests.log" 2>&1
        tail -4 "$out/tests.log"
        ;;
    table)
        run table "${TABLE_S:-420}" python3 benchmarks/fastest.py --json "$out/fastest.json" \
            >"$out/fastest.md" 2>"$out/fastest.log"
        # the tables and the explain summary (fastest.md has both explain outputs in full)
        sed -n '/^### the table/,/^Run 1 output/p' "$out/fastest.md"
        grep -E "^(Interrupted|Total wall)" "$out/fastest.md"
        grep -E "Error|Traceback" "$out/fastest.log" | head -20
        ;;
    engine)
        # shellcheck disable=SC2086  # BACKENDS and PAIRS are lists
        run engine "${ENGINE_S:-560}" python3 benchmarks/engine_gpu.py --out "$out" --no-check \
            --contenders anyattn --modes graphs --batches 16 64 --workloads ${WORKLOADS:-batch mixed} \
            --backends ${BACKENDS:-TRITON FLASH_ATTN FLASHINFER} --fastest \
            --pairs ${PAIRS:-TRITON,FLASH_ATTN FLASHINFER,FLASH_ATTN} \
            --repeats "${REPEATS:-2}" >"$out/engine.log" 2>&1
        grep -E "^ *anyattn|set up in|  measured |skipped|^\||interrupted|^wrote" "$out/engine.log"
        ;;
    *)
        echo "unknown step $step (expected tests, table, engine)"
        exit 2
        ;;
    esac
done
