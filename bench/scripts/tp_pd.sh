#!/usr/bin/env bash
# P/D between tensor-parallel engines (issue 43 item 3) on four GPUs of one host, each part
# bounded by a timeout, logs under $OUT:
#   tests   tests/test_gpu_tp.py's P/D between TP 2 and TP 1 engine daemons both ways over
#           cuda_ipc (Hugging Face's tokens), and the head-range page copy on the GPU
#   gather  bench.transfer, P at TP 2 on cuda:0-1, D at TP 1 on cuda:2: remote_send of 3,000
#           tokens against the same prefill on P alone, and migration against recompute
#   split   the same with P at TP 1 on cuda:0 and D at TP 2 on cuda:1-2
#   same    P at TP 2 on cuda:0-1, D at TP 2 on cuda:2-3
#   one     P at TP 1 on cuda:0, D at TP 1 on cuda:1 (the baseline across GPUs)
#
#   OUT=/tmp/tp-pd bash bench/scripts/tp_pd.sh tests,gather
set -u
OUT=${OUT:-/tmp/tp-pd}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off (the lent machines)
parts=",${1:-tests,gather,split},"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.csv"
if [[ $parts == *,tests,* ]]; then
  PYTHONUNBUFFERED=1 timeout 300 python -m pytest -q -p no:cacheprovider -rs -x \
    tests/test_gpu_tp.py -k cuda_ipc > "$OUT/tests.log" 2>&1; echo "tests: $?"
  PYTHONUNBUFFERED=1 timeout 100 python -m pytest -q -p no:cacheprovider -rs \
    tests/test_page_copy.py > "$OUT/page_copy.log" 2>&1; echo "page copy: $?"
fi
bench() {  # name, P's TP size, P's first GPU, D's TP size, D's first GPU
  timeout 270 python -m bench.transfer --model random:llama-3.1-8b --tokens 3000 --repeat 3 \
    --kv-transfer cuda_ipc --modes send,migrate --gpu-share 0.5 \
    --tensor-parallel-size "$2" --device "cuda:$3" \
    --receiver-tensor-parallel-size "$4" --receiver-device "cuda:$5" > "$OUT/$1.log" 2>&1
  echo "$1: $?"
}
[[ $parts == *,gather,* ]] && bench gather 2 0 1 2
[[ $parts == *,split,* ]] && bench split 1 0 2 1
[[ $parts == *,same,* ]] && bench same 2 0 2 2
[[ $parts == *,one,* ]] && bench one 1 0 1 1
exit 0
