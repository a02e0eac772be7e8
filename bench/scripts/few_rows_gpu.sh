#!/usr/bin/env bash
# The few-rows kernel (engine/kernels/few_rows.py, --few-rows-gemm) on one GPU: its GPU tests,
# its tiles against cuBLASLt per projection, then whole decode steps of 2-16 sequences with
# and without it, two rounds alternating (each round a fresh engine per side).
#
#   bench/scripts/few_rows_gpu.sh OUT_DIR [ROWS]        # ROWS: the sweep's, default 4,16
set -uo pipefail
out=$1 rows=${2:-4,16}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_few_rows.py \
    tests/test_gpu_engine.py -k "few_rows or llama_shapes" 2>&1 | tail -15 | tee "$out/gpu-tests.log"
timeout 300 python3 -m bench.gemv_sweep --few-rows "$rows" --json "$out/sweep.json" \
    > "$out/sweep.log" 2>&1
grep " m=" "$out/sweep.log"
for round in 1 2; do
    for n in 0 16; do
        timeout 120 python3 -m bench.engine_gpu --only decode2,decode4,decode8,decode16 \
            --max-num-batched-tokens 2048 --few-rows-gemm "$n" \
            --json "$out/steps-r$round-fr$n.json" > "$out/steps-r$round-fr$n.log" 2>&1
        grep -h '"step_ms"' "$out/steps-r$round-fr$n.log" | tail -4 | sed "s/^/r$round fr$n /"
    done
done
