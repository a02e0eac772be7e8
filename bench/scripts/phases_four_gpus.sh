#!/usr/bin/env bash
# Issue 44's shifting mix on four GPUs: two 1P1D pairs side by side, pair A on GPUs 0-1 (router
# on port 8000), pair B on GPUs 2-3 (port 9000), each one `microserve up` of DEPLOYMENT at SEATS
# sequences an engine running its own strategies on the same phases, one after another
# (bench/scripts/phases_two_gpus.sh). Both pairs start together, so a fixed strategy on one pair
# runs beside `auto` on the other; `auto` on both pairs says how far apart the pairs are.
#
#   bench/scripts/phases_four_gpus.sh deploy/gpu-1p1d.toml 96 OUT_DIR \
#       "chat@28:15,synthetic@9:300,chat@28:15" "auto=auto{...}" dp
#
# Writes OUT_DIR/A and OUT_DIR/B (bench.log, up.log, the JSON of each strategy's run).
set -euo pipefail
deployment=$1 seats=$2 out=$3 phases=$4 strategy_a=$5 strategy_b=$6
here=$(dirname "$0")
mkdir -p "$out/A" "$out/B"
bash "$here/phases_two_gpus.sh" "$deployment" "$seats" "$out/A" \
    "--phases $phases --strategy $strategy_a" >"$out/A/bench.log" 2>&1 &
a=$!
sleep 2  # the second router's token file and ports after the first's
GPU_BASE=2 PORT=9000 bash "$here/phases_two_gpus.sh" "$deployment" "$seats" "$out/B" \
    "--phases $phases --strategy $strategy_b" >"$out/B/bench.log" 2>&1 &
b=$!
status=0
wait "$a" || status=$?
wait "$b" || status=$?
grep -h -E "phased|phase " "$out/A/bench.log" "$out/B/bench.log" || true
exit "$status"
