#!/usr/bin/env bash
# Creates the virtual environment test_sglang.py runs in: SGLang's wheel
# from PyPI with --no-deps, the torch and transformers it pins, the other
# packages its loader and model-loading modules import, and dmaload built
# from this checkout. Kept apart from vLLM's (setup-vllm.sh): SGLang pins
# another torch.
#
#   bash tests/engines/setup-sglang.sh        # prints the venv's python last
#   DMALOAD_SGLANG_VENV=/path ...             # where (default tests/engines/.venv-sglang)
#   SGLANG_VERSION=0.5.23 ...                 # which sglang release
#
# SGLang's requirements are a CUDA build's (flashinfer, sgl-kernel, its
# CUDA kernels, cuda-python, ...): none of those is needed to import its
# loader and run it on CPU, so only the packages named in $needed are
# installed, each at the version SGLang's METADATA asks for. PyPI's torch
# brings the CUDA runtime wheels along (a few GiB); none of it needs a GPU.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${DMALOAD_SGLANG_VENV:-$here/.venv-sglang}"
version="${SGLANG_VERSION:-0.5.23}"
python="${PYTHON:-python3}"
started=$SECONDS
step() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - started)) >&2; }

# What `from sglang.srt.model_loader.loader import DefaultModelLoader` and
# its model-loading code import (found by importing it until it stopped
# failing), besides torch and transformers.
needed="torch transformers torchvision orjson psutil pyzmq msgspec pybase64 requests aiohttp pydantic
setproctitle einops xxhash distro interegular partial_json_parser python-multipart fastapi uvicorn uvloop
prometheus-client pillow IPython dill scipy sentencepiece tiktoken gguf blobfile zstandard watchfiles
soundfile pyyaml jinja2 apache-tvm-ffi compressed-tensors openai numpy tqdm safetensors"

if [ ! -x "$venv/bin/python" ]; then
    step "virtual environment $venv"
    "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check "$@"; }

if [ "$("$py" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null)" != "$version" ]; then
    pip install --quiet --upgrade pip packaging
    wheels="$(mktemp -d)"
    trap 'rm -rf "$wheels"' EXIT
    step "sglang $version (wheel only)"
    pip download --quiet --no-deps --dest "$wheels" "sglang==$version"
    wheel="$(ls "$wheels"/sglang-*.whl)"
    # The needed packages at SGLang's versions (a package it does not
    # name, unpinned); torch held at SGLang's pin for torchvision too.
    "$py" - "$wheel" "$wheels" $needed <<'PY'
import sys, zipfile, email.parser, pathlib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
wheel, out, needed = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = email.parser.Parser().parsestr(z.read(name).decode())
pinned = {}
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    req.extras = set()
    pinned[canonicalize_name(req.name)] = str(req)
reqs = [pinned.get(canonicalize_name(n), n) for n in needed]
torch = pinned.get("torch")
if torch is None:
    sys.exit(f"{wheel}: no torch requirement in its METADATA")
(out / "requirements.txt").write_text("\n".join(reqs) + "\n")
(out / "constraints.txt").write_text(torch + "\n")
print(f"{torch} and {len(reqs) - 1} other requirements", file=sys.stderr)
PY
    step "torch and the packages SGLang's loader imports, from PyPI"
    pip install --quiet -c "$wheels/constraints.txt" -r "$wheels/requirements.txt"
    step "sglang --no-deps"
    pip install --quiet --no-deps "$wheel"
fi

step "dmaload from this checkout"
pip install --quiet "maturin>=1.9,<2" pytest
(cd "$root/bindings/python" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" develop --release --quiet)
step "ready"
echo "$py"
