"""vLLM's CPU build serving a tiny Llama with --load-format dmaload.

Runs in the environment tests/engines/setup-vllm.sh makes (vLLM pins its
own torch); tests/engines/ci.sh runs it. Each engine runs in its own process
(generate.py), whose output shows which loader loaded the weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

HERE = Path(__file__).parent
GUARD_S = 900  # an engine still starting after this has hung: the test fails


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(HERE))
    from tiny_llama import make

    # Several shards with an index: the loader is handed a list of files.
    return make(tmp_path_factory.mktemp("tiny-llama"), layers=4, hidden=128, intermediate=256, shard_size="300KB")


def _reads(output: str) -> list[float]:
    """GiB of the checkpoint each rank's summary line says it read."""
    return [float(x) for x in re.findall(r"this process read ([0-9.]+) GiB of the checkpoint", output)]


def _size(model: Path) -> float:
    return sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30


def _serve(model: Path, load_format: str, extra: dict[str, object] | None = None, tp: int = 1,
           env: dict[str, str] | None = None) -> tuple[list[int], str]:
    """The greedy tokens of generate.py's prompt, and the engine's output."""
    run = subprocess.run(
        [sys.executable, str(HERE / "generate.py"), str(model), load_format, json.dumps(extra or {}), str(tp)],
        capture_output=True,
        text=True,
        timeout=GUARD_S,
        env={**os.environ, **(env or {})},
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])["tokens"], output


@pytest.fixture(scope="module")
def safetensors_run(tiny_llama: Path) -> tuple[list[int], str]:
    """vLLM's own safetensors loader: the tokens every dmaload run must give."""
    return _serve(tiny_llama, "safetensors")


def test_dmaload_serves_the_same_tokens_as_safetensors(tiny_llama: Path, safetensors_run: tuple[list[int], str]) -> None:
    reference, reference_output = safetensors_run
    tokens, output = _serve(tiny_llama, "dmaload", {"window": "256K"})
    assert tokens == reference
    assert len(tokens) == 16
    # The plugin registered the format, and dmaload's iterator loaded
    # every tensor (its summary line; vLLM's own loader prints none).
    assert "DmaloadModelLoader" in output and "with load format `dmaload`" in output
    assert "dmaload: loaded 39 tensors" in output, output[-4000:]
    assert "1 rank(s) shared the reads" in output
    # What it read of the checkpoint: its files, headers and all.
    assert _reads(output) == [pytest.approx(_size(tiny_llama), abs=0.0006)], output[-4000:]
    assert "Loading weights took" in output
    # One rank: the read began in create_model, before vLLM built the
    # model, and the weights iterator took it over (its summary says so).
    assert "before the engine asked for the first tensor (before the model was built)" in output, output[-4000:]
    assert "dmaload: loaded" not in reference_output


def test_an_s3_model_serves_the_same_tokens_as_safetensors(
    tiny_llama: Path, safetensors_run: tuple[list[int], str], tmp_path: Path
) -> None:
    """An engine whose weights are in object storage (a real S3 server,
    Garage, as bindings/python/tests/test_object_store.py starts it):
    ``model`` the directory of the config files, the extra config's
    ``weights`` the prefix of the shards; the same greedy tokens as vLLM's
    loader of the files on disk."""
    sys.path.insert(0, str(HERE.parents[1] / "bindings/python/tests"))
    from test_object_store import Garage, garage_binary

    binary = garage_binary()
    if binary is None:
        print("SKIP test_an_s3_model_serves_the_same_tokens_as_safetensors: no garage binary")
        pytest.skip("no garage binary")
    (tmp_path / "garage").mkdir()
    garage = Garage(binary, tmp_path / "garage")
    try:
        configs = tmp_path / "configs"
        configs.mkdir()
        for f in tiny_llama.iterdir():
            if f.name.endswith((".safetensors", ".safetensors.index.json")):
                garage.put(f"tiny/{f.name}", f.read_bytes())
            elif f.is_file():
                (configs / f.name).write_bytes(f.read_bytes())
        env = {**garage.env(), "HOME": str(tmp_path)}
        tokens, output = _serve(configs, "dmaload", {"weights": "s3://models/tiny/"}, env=env)
    finally:
        garage.stop()
    assert tokens == safetensors_run[0]
    shards = len(list(tiny_llama.glob("*.safetensors")))
    assert f"dmaload: streaming {shards} shard(s) from object storage" in output, output[-4000:]


def test_two_tensor_parallel_ranks_share_the_reads(tiny_llama: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        if os.environ.get("DMALOAD_TEST_NO_SKIP") == "1":
            pytest.fail("two tensor-parallel CPU workers need two CPUs")
        pytest.skip("SKIP vllm tp=2: two tensor-parallel CPU workers need two CPUs")
    # vLLM's CPU workers bind their threads to NUMA nodes, one node each by
    # default; on one node, one CPU per worker.
    bind = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}
    reference, _ = _serve(tiny_llama, "safetensors", tp=2, env=bind)
    tokens, output = _serve(tiny_llama, "dmaload", tp=2, env=bind)
    assert tokens == reference
    assert output.count("2 rank(s) shared the reads") == 2, output[-4000:]
    # Each rank read its half of the tensors (and every header): the
    # checkpoint once between them.
    assert sum(_reads(output)) == pytest.approx(_size(tiny_llama), abs=0.002), output[-4000:]
    # Several ranks start reading when vLLM asks for the weights: their
    # exchanges must not run beside whatever vLLM does building the model.
    assert "before the model was built" not in output


def test_a_restarted_engine_takes_its_weights_from_the_cache_service(
    tiny_llama: Path, safetensors_run: tuple[list[int], str], tmp_path: Path
) -> None:
    sys.path.insert(0, str(HERE.parents[1] / "bindings" / "python" / "tests"))
    from test_cache import Service  # skips where the native CLI is not built

    service = Service(tmp_path / "cache.sock")
    try:
        first, _ = _serve(tiny_llama, "dmaload", {"cache": str(service.socket)})
        restarted, output = _serve(tiny_llama, "dmaload", env={"DMALOAD_CACHE": str(service.socket)})
        status = service.status()
    finally:
        service.stop()
    assert first == restarted == safetensors_run[0]
    assert "dmaload: loaded 39 tensors" in output
    shards = len(list(tiny_llama.glob("*.safetensors")))
    # Every file came from the service: this process read none of them.
    assert f"this process read 0.000 GiB of the checkpoint ({shards} of {shards} file(s) from the model-cache service)" in output
    # The first engine's loads filled the service; the restarted one's were hits.
    assert (status["misses"], status["hits"]) == (shards, shards), status
