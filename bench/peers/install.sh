#!/usr/bin/env bash
# On the device machine: stash the parts this call carried, and once all have arrived, join
# them, check every digest and install vLLM and its needs into /tmp/peers-site (no registry
# is reached; --no-deps, the set was chosen by bench/peers/fetch.sh).
#
#   bash bench/peers/install.sh        # from the checkout's root; prints what is still missing
#
# Exit status: 0 installed (or already installed), 2 parts still missing, 1 anything else.
# The parts are kept in /tmp/peers-parts, outside the checkout, so those of earlier calls
# count while the machine stays warm; a fresh machine starts from none.
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=${PEERS_SITE:-/tmp/peers-site}
STASH=${PEERS_STASH:-/tmp/peers-parts}
MANIFEST=.peers/manifest.json

if [ -f "$SITE/.installed" ] && cmp -s "$SITE/.installed" "$MANIFEST"; then
  echo "peers: already installed in $SITE"
  exit 0
fi
[ -f "$MANIFEST" ] || { echo "peers: no $MANIFEST here: carry it in every call" >&2; exit 1; }

rc=0
python3 bench/peers/parts.py join --manifest "$MANIFEST" --parts .peers/parts \
  --stash "$STASH" --out /tmp/peers-wheels || rc=$?
[ $rc -eq 0 ] || exit $rc

rm -rf "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
  /tmp/peers-wheels/*.whl
rm -rf /tmp/peers-wheels "$STASH"
cp "$MANIFEST" "$SITE/.installed"
if [ "${PEERS_CHECK:-1}" = 1 ]; then
  # vLLM's server imports also what our own .whl/ brings (pydantic, uvicorn, llguidance...):
  # the README's first command installs that into /tmp/site
  PYTHONPATH="$SITE:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    'import vllm.entrypoints.openai.api_server, vllm, torch; print("peers: vllm", vllm.__version__, "torch", torch.__version__)'
fi
echo "peers: installed in $SITE; run vLLM with PYTHONPATH=$SITE:\$PYTHONPATH"
