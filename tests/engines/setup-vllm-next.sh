#!/usr/bin/env bash
# The newest vLLM release beside the CPU build, for the loader-level tests
# (test_vllm_loader.py): a venv that sees setup-vllm.sh's (torch,
# transformers, dmaload built from this checkout) and holds vLLM's PyPI
# wheel, installed with --no-deps. That wheel is a CUDA build pinning
# another torch; its loader classes import and run on CPU with the CPU
# build's torch, which is all these tests use (no engine starts here).
#
#   bash tests/engines/setup-vllm-next.sh BASE_PYTHON   # prints the venv's python last
#   DMALOAD_VLLM_NEXT_VENV=/path ...     # where (default tests/engines/.venv-vllm-next)
#   VLLM_NEXT_VERSION=0.33.0 ...         # which vllm release
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
base_py="$1"
venv="${DMALOAD_VLLM_NEXT_VENV:-$here/.venv-vllm-next}"
version="${VLLM_NEXT_VERSION:-0.33.0}"
started=$SECONDS
step() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - started)) >&2; }

if [ ! -x "$venv/bin/python" ]; then
    step "virtual environment $venv over $base_py's packages"
    "$base_py" -m venv --without-pip "$venv"
fi
py="$venv/bin/python"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
base_site="$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir, not a plain path: the base's own .pth files (dmaload's
# editable install among them) apply too. Sorted last, after this venv's vllm.
echo "import site; site.addsitedir('$base_site')" >"$site/zzz_base.pth"

if [ "$("$py" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)" != "$version" ]; then
    wheels="$(mktemp -d)"
    trap 'rm -rf "$wheels"' EXIT
    step "vllm $version (wheel only, --no-deps)"
    "$py" -m pip --disable-pip-version-check download --quiet --no-deps --dest "$wheels" "vllm==$version"
    "$py" -m pip --disable-pip-version-check install --quiet --no-deps --target "$site" --upgrade "$wheels"/vllm-*.whl
fi
step "ready: vllm $("$py" -c 'import vllm; print(vllm.__version__)')"
echo "$py"
