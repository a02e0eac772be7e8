#!/usr/bin/env bash
# The wheels a lent GPU machine needs and lacks (its image has torch, triton, httpx, anyio, pytest
# and more, but not the web stack: DESIGN.md section 10), downloaded for its Python 3.12 into the
# ignored .whl/ folder, at the versions this checkout's .venv runs (`make install-test` first), with
# what they need in turn. A device call carries .whl and installs it before anything else:
#
#   bench/scripts/device_wheels.sh            # then, on the device:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#
# Checked here: every wheel's own requirements are in .whl or in the image (IMAGE below), so
# that a new dependency (fastapi 0.16x's opentelemetry-api: an `up` that died at import cost
# two device calls on 2026-11-28) fails here, not on the device.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
WANT="fastapi uvicorn starlette pydantic pydantic-core annotated-types annotated-doc
      typing-inspection typing-extensions opentelemetry-api msgspec httptools llguidance
      pytest-asyncio python-multipart uvloop h11 click"
# on the image already (2026-11-22): not carried, so that ours never shadow its builds
IMAGE="anyio idna sniffio httpx httpcore certifi pytest pluggy iniconfig packaging msgpack numpy
       importlib-metadata zipp"
pins=()
for name in $WANT; do
    version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    pins+=("$name==$version")
done
mkdir -p .whl
tags=()
for t in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_34_x86_64 any; do
    tags+=(--platform "$t")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${tags[@]}" -d .whl "${pins[@]}" "nvshmem4py-cu13==0.4.1"
"$py" - "$WANT" "$IMAGE" <<'PY'
import importlib.metadata as m
import sys

from packaging.requirements import Requirement

carried = {n.lower() for n in sys.argv[1].split()} | {"nvshmem4py-cu13"}
image = {n.lower() for n in sys.argv[2].split()}
device = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "extra": ""}  # the image's Python
missing = []
for name in sorted(carried - {"nvshmem4py-cu13"}):
    for text in m.requires(name) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(device):
            continue
        dep = req.name.lower().replace("_", "-")
        if dep not in carried and dep not in image:
            missing.append(f"{name} needs {dep}")
if missing:
    sys.exit("not in .whl nor on the image: " + "; ".join(missing))
print(f"{len(carried)} packages carried, each one's requirements met")
PY
ls .whl
