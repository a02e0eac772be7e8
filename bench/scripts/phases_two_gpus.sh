#!/usr/bin/env bash
# Issue 44's shifting mix on two GPUs: a 1P1D deployment whose engines run SEATS sequences at
# once (--max-num-seqs), then each remaining argument one bench.strategies argument string
# (as bench/scripts/pd_two_gpus.sh, which this wraps). With fewer seats than the default 256,
# one decode engine's seats fill at a chat rate the router's one process can still stream
# (at 256, only past ~20k streamed tokens/s), so the chat phase parts P/D from data parallel.
#
#   bench/scripts/phases_two_gpus.sh deploy/gpu-1p1d.toml 96 OUT_DIR \
#       "--workload chat --rates 20,28 --strategy dp --strategy 1p1d-balance-0.3" \
#       "--phases chat@28:10,synthetic@9:90,chat@28:10 --strategy dp ..."
set -euo pipefail
deployment=$1 seats=$2 out=$3
shift 3
mkdir -p "$out"
seated="$out/$(basename "$deployment" .toml)-seats$seats.toml"
python3 -c '
import sys
from pathlib import Path
from bench.batch_bench import with_engine_args  # every engine gets the args first
with_engine_args(sys.argv[1], ["--max-num-seqs", sys.argv[2]], Path(sys.argv[3]))
' "$deployment" "$seats" "$seated"
exec bash "$(dirname "$0")/pd_two_gpus.sh" "$seated" "$out" "$@"
