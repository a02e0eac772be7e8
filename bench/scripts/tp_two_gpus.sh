#!/usr/bin/env bash
# Tensor parallelism on two GPUs (issue 43), each part bounded by a timeout, logs under $OUT:
#   tests     the gpu-marked TP tests (fp32 TP 2 tokens equal TP 1's and Hugging Face's)
#   allreduce NCCL and one-shot all-reduce latency side by side, eager and in a CUDA graph,
#             8 KiB to 1 MiB
#   allreduce-large  NCCL and the copy-engine exchange, eager, 1 to 64 MiB (prompt steps)
#   8b-prefill  8 x 4,096 prefill, alternating TP 1, TP 2 (--all-reduce auto: the copy-engine
#             exchange), TP 2 --all-reduce one-shot (NCCL for prompt steps), twice each
#             (PREFILL_CONFIGS="TP ALL_REDUCE OVERLAP_TOKENS,...": other configurations)
#   8b-ar     random:llama-3.1-8b bf16 at TP 2, --all-reduce nccl then one-shot: batch-1
#             decode and 128-sequence decode
#   8b-serial random:llama-3.1-8b bf16 at TP 2, 8 x 4,096 prefill with --tp-overlap-tokens 0
#             (every all-reduce after its GEMM, the A/B of the overlapped halves)
#   8b        random:llama-3.1-8b bf16 at TP 1 and TP 2: batch-1 decode, 8 x 4,096 prefill,
#             128-sequence decode (bench.engine_gpu)
#   70b       random:llama-3.1-70b at TP 2 (bf16 on cards of >= 100 GB, else fp8 weights):
#             batch-1 decode and 128-sequence decode
#   hbm       the GPU's memory bandwidth (a large device copy), for the weights-read roofline
#   serve     random:llama-3.1-70b through `microserve up deploy/gpu-tp2.toml`: bench.serve,
#             200 requests of 1,024 in / 128 out at once
#
#   OUT=/tmp/tp bash bench/scripts/tp_two_gpus.sh tests,allreduce,8b
set -u
OUT=${OUT:-/tmp/tp-two-gpus}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off (the lent machines)
parts=",${1:-tests,allreduce,8b},"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpus.csv"
if [[ $parts == *,tests,* ]]; then
  PYTHONUNBUFFERED=1 timeout 420 python -m pytest -q -p no:cacheprovider -rs tests/test_gpu_tp.py \
    ${TESTS_K:+-k "$TESTS_K"} > "$OUT/tests.log" 2>&1; echo "tests: $?"
fi
if [[ $parts == *,allreduce,* ]]; then
  timeout 120 python -m bench.allreduce --json "$OUT/allreduce.json" > "$OUT/allreduce.log" 2>&1
  echo "allreduce: $?"
fi
if [[ $parts == *,allreduce-large,* ]]; then
  timeout 120 python -m bench.allreduce --sizes-kib 1024,4096,16384,32768,65536 --iters 60 \
    --impls nccl,copy-engine --json "$OUT/allreduce-large.json" > "$OUT/allreduce-large.log" 2>&1
  echo "allreduce-large: $?"; grep '^{' "$OUT/allreduce-large.log"
fi
if [[ $parts == *,8b-prefill,* ]]; then
  # each of PREFILL_CONFIGS: tensor-parallel size, --all-reduce, --tp-overlap-tokens
  IFS=, read -ra configs <<< "${PREFILL_CONFIGS:-1 auto 4096,2 auto 4096,2 one-shot 4096}"
  for run in 1 2; do
    for cfg in "${configs[@]}"; do
      set -- $cfg
      timeout 240 python -m bench.engine_gpu --only prefill --tensor-parallel-size $1 \
        --all-reduce $2 --tp-overlap-tokens $3 --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
      echo "prefill run $run tp$1 $2 overlap $3: $? $(python -c "import json
print(round(json.load(open('$OUT/prefill.json'))['prefill']['tokens_per_s']))" 2>&1)"
      cat "$OUT/prefill.log" >> "$OUT/prefill-all.log"
    done
  done
fi
if [[ $parts == *,8b,* ]]; then
  for tp in 1 2; do
    timeout 300 python -m bench.engine_gpu --only decode1,prefill,decode128 \
      --tensor-parallel-size $tp --json "$OUT/8b-tp$tp.json" > "$OUT/8b-tp$tp.log" 2>&1
    echo "8b tp$tp: $?"
  done
fi
if [[ $parts == *,8b-ar,* ]]; then
  for ar in nccl one-shot; do
    timeout 300 python -m bench.engine_gpu --only decode1,decode128 --tensor-parallel-size 2 \
      --all-reduce $ar --json "$OUT/8b-tp2-$ar.json" > "$OUT/8b-tp2-$ar.log" 2>&1
    echo "8b tp2 $ar: $?"
  done
fi
if [[ $parts == *,8b-serial,* ]]; then
  timeout 300 python -m bench.engine_gpu --only prefill --tensor-parallel-size 2 \
    --tp-overlap-tokens 0 --json "$OUT/8b-tp2-serial.json" > "$OUT/8b-tp2-serial.log" 2>&1
  echo "8b tp2 serial: $?"
fi
if [[ $parts == *,70b,* ]]; then
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  quant=(); [[ $mem -lt 100000 ]] && quant=(--quantization fp8)
  timeout 330 python -m bench.engine_gpu --model random:llama-3.1-70b "${quant[@]}" \
    --only decode1,decode128 --tensor-parallel-size 2 --max-num-batched-tokens 2048 \
    --json "$OUT/70b-tp2.json" > "$OUT/70b-tp2.log" 2>&1
  echo "70b tp2 ${quant[*]}: $?"
fi
if [[ $parts == *,hbm,* ]]; then
  timeout 60 python -c "
import torch, time
x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): y.copy_(x)
torch.cuda.synchronize(); s = (time.perf_counter() - t) / 20
print('hbm copy GB/s (read + write)', 2 * x.numel() / s / 1e9)" > "$OUT/hbm.log" 2>&1
  echo "hbm: $?"
fi
if [[ $parts == *,serve,* ]]; then
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  model=random:llama-3.1-70b; [[ $mem -lt 100000 ]] && model=random:llama-3.1-8b
  setsid python -m launcher.cli up deploy/gpu-tp2.toml --model $model --port 8000 \
    > "$OUT/up.log" 2>&1 &
  up=$!
  for _ in $(seq 240); do
    curl -sf http://127.0.0.1:8000/v1/models > /dev/null && break; sleep 1
  done
  timeout 240 python -m bench.serve --num-requests 200 --input-len 1024 --output-len 128 \
    --vocab 128000 --json "$OUT/serve-${model//:/-}.json" > "$OUT/serve.log" 2>&1
  echo "serve $model: $?"
  # `up` stops its engines on SIGINT; a 70B engine takes a while to let its GPUs go, and one
  # killed before it did held 129 GiB into the next run (2026-11-28): wait up to 90 s
  kill -INT -- -$up
  for _ in $(seq 90); do kill -0 $up 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$up 2>/dev/null
fi
