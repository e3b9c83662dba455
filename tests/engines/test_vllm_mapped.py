"""A warm load through vLLM's loader maps the page cache (read leases), and
a checkpoint truncated and rewritten by another process while the loader
hands out those views yields an error or, in every tensor, the bytes of
exactly one version: never a signal (SIGBUS) in the loading process. The
files being warm and leasable, the loader maps them and the load succeeds
with the version it mapped.

The loader runs in a child process (its exit status tells a signal from
an error); this process is the writer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from tiny_llama import make  # noqa: E402

# The child: vLLM's get_all_weights through --load-format dmaload. After
# the first tensor it says so and waits (holding that tensor, a view of the
# mapping) until the writer is done, then takes the rest; every tensor is
# saved, and the first is read again at the end.
LOADER = textwrap.dedent(
    """
    import logging, sys
    from types import SimpleNamespace
    import torch
    from vllm.config.load import LoadConfig
    from dmaload.engines.vllm import DmaloadModelLoader

    lines = []
    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    log = logging.getLogger("vllm.dmaload")
    log.addHandler(Lines())
    log.setLevel(logging.INFO)

    class Model(torch.nn.Module):
        secondary_weights = []

    loader = DmaloadModelLoader(LoadConfig(load_format="dmaload"))
    got, first = {}, None
    for name, tensor in loader.get_all_weights(SimpleNamespace(model=sys.argv[1], revision=None), Model()):
        if first is None:
            first = (name, tensor)
            print("first", flush=True)
            sys.stdin.readline()
        got[name] = tensor.clone()
    assert torch.equal(first[1], got[first[0]])
    torch.save(got, sys.argv[2])
    print("\\n".join(lines), flush=True)
    """
)


def _tensors(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(model.glob("*.safetensors")):
        # Copies: safetensors' tensors map the file, which is rewritten below.
        out.update({n: t.clone() for n, t in load_file(shard).items()})
    return out


def test_a_warm_load_truncated_and_rewritten_meanwhile_gives_one_version_never_a_signal(tmp_path: Path) -> None:
    old = make(tmp_path / "old", layers=3, hidden=128, intermediate=256, shard_size="300KB", seed=0)
    new = make(tmp_path / "new", layers=3, hidden=128, intermediate=256, shard_size="300KB", seed=1)
    shards = sorted(old.glob("*.safetensors"))
    assert len(shards) > 1 and [s.name for s in shards] == sorted(s.name for s in new.glob("*.safetensors"))
    versions = (_tensors(old), _tensors(new))
    for shard in shards:  # warm: the mapped path needs every page cached
        shard.read_bytes()
    from dmaload._dmaload import LeasedFile

    try:
        LeasedFile(shards[0])  # dropped at once: the lease goes with it
    except OSError as exc:  # a filesystem without leases, a short break time
        pytest.skip(f"SKIP mapped vLLM load: {exc}")
    out = tmp_path / "got.pt"
    child = subprocess.Popen(
        [sys.executable, "-c", LOADER, str(old), str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "first"
        # Each shard truncated (an O_TRUNC open, which waits for the
        # loader's lease) and written with the other version's bytes.
        for shard in shards:
            with open(shard, "wb") as f:
                f.write((new / shard.name).read_bytes())
        child.stdin.write("\n")
        child.stdin.flush()
        log = child.stdout.read()
    finally:
        child.wait(timeout=300)
    assert child.returncode >= 0, f"the loader died of signal {-child.returncode}"
    # An error would be safe too, but the files were warm and leasable: the
    # loader mapped them, and a mapped load keeps the version it mapped
    # (the read path fails here: the files changed under its reads).
    assert child.returncode == 0, f"the load failed (see its stderr above): {log}"
    assert "mapped from the page cache under read leases" in log, log
    got = torch.load(out)
    assert sorted(got) == sorted(versions[0])
    for name, tensor in got.items():
        assert any(torch.equal(tensor, v[name]) for v in versions), f"{name}: neither version's bytes"
    # The shards now hold the new version; the loader kept the old one.
    assert all(torch.equal(t, versions[1][n]) for n, t in _tensors(old).items())


def test_a_checkpoint_open_for_writing_is_read_not_mapped(tmp_path: Path) -> None:
    import logging

    from types import SimpleNamespace

    from vllm.config.load import LoadConfig

    from dmaload.engines.vllm import DmaloadModelLoader

    model = make(tmp_path / "m", layers=2, hidden=64, intermediate=128, shard_size="5GB")
    shard = next(model.glob("*.safetensors"))
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("vllm.dmaload")
    handler = Lines()
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)  # setLevel, not an assignment: it clears the logger's cached level checks
    fd = os.open(shard, os.O_WRONLY)  # a writer elsewhere: no lease is granted
    try:
        loader = DmaloadModelLoader(LoadConfig(load_format="dmaload"))
        model_stub = torch.nn.Module()
        model_stub.secondary_weights = []  # type: ignore[assignment]
        got = {n: t.clone() for n, t in loader.get_all_weights(SimpleNamespace(model=str(model), revision=None), model_stub)}
    finally:
        os.close(fd)
        log.removeHandler(handler)
        log.setLevel(level)
    assert sorted(got) == sorted(_tensors(model))
    assert any("read, not mapped" in line and "F_SETLEASE" in line for line in lines), lines
