#!/usr/bin/env bash
# The serving-engine tests: makes the vLLM CPU environment
# (setup-vllm.sh, its own venv), then runs tests/engines with it.
#
#   bash tests/engines/ci.sh                  # from anywhere
#   DMALOAD_VLLM_VENV=/path ...               # reuse/choose the environment
#   PYTEST_ARGS="-k tensor_parallel" ...      # extra pytest arguments
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="$(bash "$here/setup-vllm.sh" | tail -n 1)"
cd "$here"
"$py" -m pytest -q -p no:cacheprovider . ${PYTEST_ARGS:-}
