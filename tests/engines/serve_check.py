"""One engine serving a tiny Llama with dmaload and with safetensors: the
same greedy tokens, and dmaload's summary line in the dmaload run's output.

    python serve_check.py vllm|sglang

For a machine with the engine installed (bench/gpu-kit.sh engines; on CPU,
test_vllm.py does the same for vLLM). Exits non-zero on a difference."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SCRIPTS = {"vllm": "generate.py", "sglang": "sglang_generate.py"}


def serve(engine: str, model: Path, load_format: str) -> tuple[list[int], str]:
    run = subprocess.run(
        [sys.executable, str(HERE / SCRIPTS[engine]), str(model), load_format], capture_output=True, text=True, timeout=900
    )
    output = run.stdout + run.stderr
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    if run.returncode != 0 or line is None:
        sys.exit(f"{engine} with {load_format} failed:\n{output[-6000:]}")
    return json.loads(line[len("RESULT ") :])["tokens"], output


if __name__ == "__main__":
    engine = sys.argv[1]
    sys.path.insert(0, str(HERE))
    from tiny_llama import make

    with tempfile.TemporaryDirectory() as tmp:
        model = make(Path(tmp) / "tiny", layers=4, hidden=128, intermediate=256, shard_size="300KB")
        reference, _ = serve(engine, model, "safetensors")
        tokens, output = serve(engine, model, "dmaload")
    summary = [x for x in output.splitlines() if "dmaload: loaded" in x]
    print(f"{engine}: safetensors {reference}\n{engine}: dmaload     {tokens}\n" + "\n".join(summary))
    if tokens != reference or not summary:
        sys.exit(f"{engine}: dmaload's tokens differ from safetensors' or its summary line is missing")
    print(f"{engine}: same tokens, loaded by dmaload")
