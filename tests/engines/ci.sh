#!/usr/bin/env bash
# The serving-engine tests, each engine in its own venv:
#   1. vLLM's CPU build (setup-vllm.sh): end to end (test_vllm.py) and at
#      loader level (test_vllm_loader.py);
#   2. the newest vLLM release beside it (setup-vllm-next.sh, --no-deps):
#      test_vllm_loader.py again;
#   3. SGLang (setup-sglang.sh, --no-deps): test_sglang.py.
#
#   bash tests/engines/ci.sh                  # from anywhere
#   DMALOAD_VLLM_VENV=/path ...               # reuse/choose vLLM's environment
#   DMALOAD_VLLM_NEXT_VENV=/path ...          # ... the newer vLLM's
#   DMALOAD_SGLANG_VENV=/path ...             # ... SGLang's
#   PYTEST_ARGS="-k tensor_parallel" ...      # extra pytest arguments
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
started=$SECONDS
step() { printf '\n== engines: %s (%ds)\n' "$*" $((SECONDS - started)); }

step "vLLM CPU build"
py="$(bash "$here/setup-vllm.sh" | tail -n 1)"
(cd "$here" && "$py" -m pytest -q -p no:cacheprovider test_vllm.py test_vllm_loader.py test_vllm_mapped.py ${PYTEST_ARGS:-})

step "newest vLLM release, loader level"
next="$(bash "$here/setup-vllm-next.sh" "$py" | tail -n 1)"
(cd "$here" && "$next" -m pytest -q -p no:cacheprovider -s test_vllm_loader.py ${PYTEST_ARGS:-})

step "SGLang, loader level"
sg="$(bash "$here/setup-sglang.sh" | tail -n 1)"
(cd "$here" && "$sg" -m pytest -q -p no:cacheprovider -rs test_sglang.py ${PYTEST_ARGS:-})
step "done"
