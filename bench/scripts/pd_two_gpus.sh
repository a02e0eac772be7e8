#!/usr/bin/env bash
# The P/D runs on two and four GPUs of docs/benchmarks.md: one `microserve up` of a deployment file with
# random:llama-3.1-8b, then each remaining argument is one `python -m bench.strategies` argument
# string run against it (strategies swapped through the admin API, no restart).
#
#   bench/scripts/pd_two_gpus.sh deploy/gpu-1p1d.toml OUT_DIR \
#       "--strategy dp --rates 3,6 --duration-s 20" "--strategy 1p1d --rates c1 --min-requests 30"
#
# Writes OUT_DIR/up.log and OUT_DIR/<file stem>-<n>.json for each invocation.
# PORT (default 8000) is the router's port; the engines take the ports after it, so two
# deployments on one machine (four GPUs) run side by side with PORT=8000 and PORT=9000.
set -euo pipefail
deployment=$1 out=$2 port=${PORT:-8000}
shift 2
export MICROSERVE_API_KEY=$(python3 -c "import secrets; print(secrets.token_urlsafe(16))")
export MICROSERVE_ADMIN_TOKEN=$(python3 -c "import secrets; print(secrets.token_urlsafe(16))")
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$out"
setsid python3 -m launcher.cli up "$deployment" --model random:llama-3.1-8b --port "$port" \
    >"$out/up.log" 2>&1 &
up=$!
trap 'kill -INT -- -$up 2>/dev/null; sleep 5; kill -KILL -- -$up 2>/dev/null || true' EXIT
stem=$(basename "$deployment" .toml)
n=0
for spec in "$@"; do
    n=$((n + 1))
    # shellcheck disable=SC2086  # each spec is a list of arguments
    python3 -m bench.strategies --base-url "http://127.0.0.1:$port" --vocab 128000 \
        --watch-pid "$up" --note "$deployment, random:llama-3.1-8b" --json "$out/$stem-$n.json" $spec
done
