#!/usr/bin/env bash
# Role flips under load on GPUs (issue 44's target: a flip completes within 2 s, no request
# failed): one `microserve up` of a deployment file with random:llama-3.1-8b, then
# bench/scripts/role_flips.py against it with the remaining arguments.
#
#   bench/scripts/role_flips.sh deploy/gpu-1p1d.toml OUT_DIR --num-requests 600 \
#       --request-rate 8 --input-len 3000 --output-len 100 --every-s 8 \
#       --flips prefill-0=decode,prefill-0=prefill,decode-0=prefill,decode-0=decode
#
# MODEL and PORT (environment) change the model and the router's port. Writes OUT_DIR/up.log; prints a `flip` line per flip and a `load` line; exits as
# role_flips.py does (1: a flip slower than --limit-s, or a request failed).
set -euo pipefail
deployment=$1 out=$2
shift 2
export MICROSERVE_ADMIN_TOKEN=$(python3 -c "import secrets; print(secrets.token_urlsafe(16))")
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
model=${MODEL:-random:llama-3.1-8b} port=${PORT:-8000}
mkdir -p "$out"
setsid python3 -m launcher.cli up "$deployment" --model "$model" --port "$port" \
    >"$out/up.log" 2>&1 &
up=$!
trap 'kill -INT -- -$up 2>/dev/null; sleep 5; kill -KILL -- -$up 2>/dev/null || true' EXIT
until grep -q "^microserve up: '" "$out/up.log"; do
    kill -0 $up 2>/dev/null || { tail -20 "$out/up.log"; exit 1; }
    sleep 1
done
python3 -m bench.scripts.role_flips --base-url "http://127.0.0.1:$port/v1" --vocab 128000 "$@"
