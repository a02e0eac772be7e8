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
#
# GPU_BASE=2 PORT=9000 runs the same deployment on GPUs 2 and 3 (cuda:N becomes cuda:N+2), the
# router on port 9000: a second pair beside the first on a four-GPU machine.
set -euo pipefail
deployment=$1 seats=$2 out=$3
shift 3
mkdir -p "$out"
seated="$out/$(basename "$deployment" .toml)-seats$seats.toml"
python3 -c '
import re
import sys
from pathlib import Path
from bench.batch_bench import with_engine_args  # every engine gets the args first
out = Path(sys.argv[3])
with_engine_args(sys.argv[1], ["--max-num-seqs", sys.argv[2]], out)
base = int(sys.argv[4])
if base:  # the pair on GPUs base and base + 1
    text = re.sub(r"cuda:(\d+)", lambda m: f"cuda:{int(m[1]) + base}", out.read_text())
    out.write_text(text)
' "$deployment" "$seats" "$seated" "${GPU_BASE:-0}"
exec bash "$(dirname "$0")/pd_two_gpus.sh" "$seated" "$out" "$@"
