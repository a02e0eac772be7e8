#!/usr/bin/env bash
# Here (a machine that reaches PyPI): download vLLM 0.24.0 and what its OpenAI server needs
# beyond the GPU image and our own .whl/, drop what Hopper never loads from vLLM's wheel, and
# cut everything into parts a device call can carry. Run it in the checkout the device calls
# copy (the session's main checkout), from its root:
#
#   bash bench/peers/fetch.sh            # -> .peers/manifest.json and .peers/parts/bundle.tar.NN
#
# PEERS_PART_MIB (default 52): the size of a part. A call carries the working tree (~9 MiB
# tracked on 2026-11-29) plus its `carry` paths, 64 MiB in all.
# PEERS_KEEP_ALL=1: keep the three libraries of vLLM's wheel that a dense model on Hopper
# never loads (116 MiB packed; see below and README.md), e.g. for an MoE model or an A100.
# PEERS_NIXL=1: add NIXL (nixl 1.5.1, the loader, and nixl-cu13 1.5.1 less nixl_ep_cu13, its
# expert-parallel kernels, built for torch 2.12-2.14 only and imported by vLLM's fused-MoE
# layers alone): vLLM's NixlConnector, its 1P1D on two GPUs (`bench.peers --gpus 2`). About
# 32 MiB more: 4 parts.
#
# Why each package is here, and why the rest of vLLM's Requires-Dist is not: README.md.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
OUT=.peers
WHEELS=$OUT/wheels
PART_MIB=${PEERS_PART_MIB:-52}
mkdir -p "$WHEELS"

# vLLM and the packages its server imports that neither the image nor .whl/ holds (or holds
# at a version vLLM's pins exclude: fastapi < 0.137). Exact versions: the bundle is the same
# for whoever runs this.
PACKAGES=(
  vllm==0.24.0
  fastapi==0.136.3
  openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  openai-harmony==0.0.8
  pyzmq==27.3.0
  cbor2==6.3.0 cachetools==8.0.2 pybase64==1.5.1
  partial-json-parser==0.2.1.1.post7
  watchfiles==1.3.0
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
  model-hosting-container-standards==0.1.16 jmespath==1.1.0
  prometheus-fastapi-instrumentator==8.0.0
)
if [ "${PEERS_NIXL:-0}" = 1 ]; then
  PACKAGES+=(nixl==1.5.1 nixl-cu13==1.5.1)
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
  "${PACKAGES[@]}"

# vLLM's wheel less what a dense model on Hopper never loads, each imported inside a `try`:
# FlashAttention 2 (vLLM picks FA3 on sm_90: platforms/cuda.py, v1/attention/backends/
# fa_utils.py), the MoE kernels (platforms/cuda.py import_kernels; only fused-MoE layers call
# them) and the Rust front end vllm-rs (only with VLLM_USE_RUST_FRONTEND=1). `zip -d` removes
# entries without repacking the rest; pip does not check RECORD against the files.
WHL=$(ls "$WHEELS"/vllm-0.24.0-*.whl)
DROP=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs)
if [ "${PEERS_KEEP_ALL:-0}" != 1 ] && unzip -l "$WHL" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' >/dev/null 2>&1; then
  zip -q -d "$WHL" "${DROP[@]}"
fi

NIXL_WHL=$(ls "$WHEELS"/nixl_cu13-1.5.1-*.whl 2>/dev/null || true)
if [ "${PEERS_NIXL:-0}" = 1 ] && [ -n "$NIXL_WHL" ] && unzip -l "$NIXL_WHL" 'nixl_ep_cu13/*' >/dev/null 2>&1; then
  zip -q -d "$NIXL_WHL" 'nixl_ep_cu13/*'
elif [ "${PEERS_NIXL:-0}" != 1 ]; then
  rm -f "$WHEELS"/nixl-1.5.1-*.whl "$WHEELS"/nixl_cu13-1.5.1-*.whl  # from an earlier PEERS_NIXL=1
fi

python3 bench/peers/parts.py split --out "$OUT" --part-mib "$PART_MIB" "$WHEELS"/*.whl
du -b --apparent-size "$OUT"/parts/* | awk '{s+=$1} END {printf "peers: %.1f MiB in %d parts\n", s/1048576, NR}'
TREE=$(git ls-files -z | du -cb --apparent-size --files0-from=- | tail -1 | cut -f1)
awk -v t="$TREE" -v p="$PART_MIB" 'BEGIN { if (t / 1048576 + p > 63)
  printf "peers: WARNING the tree (%.1f MiB) and one part (%s MiB) pass 63 MiB: lower PEERS_PART_MIB\n", t / 1048576, p }'
