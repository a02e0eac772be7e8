#!/usr/bin/env bash
# Issue 44's A/B target on two GPUs: does an A/B of two strategies inside one router give the
# ordering (and, within its intervals, the difference) that running each strategy alone on the
# same schedule gives? One `microserve up` of DEPLOYMENT with random:llama-3.1-8b, then three
# `microserve ab` runs of the same seeded Poisson schedule: strategy A alone (B at weight 0),
# B alone (A at weight 0), and A and B as 1:1 arms.
#
#   bench/scripts/ab_two_gpus.sh deploy/gpu-1p1d.toml OUT_DIR [RATE] [DURATION_S]
#
# Writes OUT_DIR/up.log and OUT_DIR/{a_alone,b_alone,ab}.{txt,json}: each .txt is the
# comparison table (rows "a ..." and "b ...", then "difference b-a: ...").
set -euo pipefail
deployment=$1 out=$2 rate=${3:-4} duration=${4:-60}
export MICROSERVE_ADMIN_TOKEN=$(python3 -c "import secrets; print(secrets.token_urlsafe(16))")
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$out"
setsid python3 -m launcher.cli up "$deployment" --model random:llama-3.1-8b --port 8000 \
    >"$out/up.log" 2>&1 &
up=$!
trap 'kill -INT -- -$up 2>/dev/null; sleep 5; kill -KILL -- -$up 2>/dev/null || true' EXIT
until grep -q "microserve up:" "$out/up.log"; do
    kill -0 $up 2>/dev/null || { cat "$out/up.log"; exit 1; }
    sleep 2
done
a=data_parallel b=balanced_pd:ratio=0.3
# Each run has the same lengths and arrivals (--seed 0) and prompts of its own (--prompt-seed):
# a later run resending an earlier one's prompts would time prefix-cache hits.
n=0
for run in "a_alone:a=$a b=$b@0" "b_alone:a=$a@0 b=$b" "ab:a=$a b=$b"; do
    name=${run%%:*} arms=${run#*:} n=$((n + 1))
    set -- $arms
    python3 -m launcher.cli ab --base-url http://127.0.0.1:8000 --arm "$1" --arm "$2" \
        --duration-s "$duration" --rate "$rate" --input-len 3000 --output-len 100 \
        --max-len 4096 --vocab 128000 --seed 0 --prompt-seed $n --json "$out/$name.json" | tee "$out/$name.txt"
done
