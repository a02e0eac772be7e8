#!/usr/bin/env bash
# Issue 40's swap-against-recompute figure on one GPU (docs/benchmarks.md): the host tier's GPU
# tests, then bench.policies under KV pressure (2,048 pages, prompts ~2,048 tokens, 12 req/s)
# with recomputation only and with a 32-GB host tier, for each policy given.
#
#   bench/scripts/swap_gpu.sh OUT_DIR fcfs,mlfq
set -uo pipefail
out=$1 policies=${2:-fcfs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_host_swap.py \
    tests/test_prefix_host_engine.py 2>&1 | tail -25 | tee "$out/gpu-tests.log"
W=(--rates 12 --num-requests 400 --workload custom --input-len lognormal:2048:0.5
   --output-len lognormal:128:1.2 --max-len 4096 --vocab 128000)
for tier in recompute swap; do
    extra=()
    [ "$tier" = swap ] && extra=(--kv-host-memory-gb 32)
    timeout 200 python3 -m bench.policies --model random:llama-3.1-8b --device cuda \
        --policies "$policies" "${W[@]}" --json "$out/$tier.json" \
        -- --max-num-seqs 32 --num-pages 2048 "${extra[@]}" 2>&1 | tee "$out/$tier.log"
done
