"""What the serving-engine loaders share, without an engine installed (the
engines themselves: tests/engines, in vLLM's own environment)."""

from __future__ import annotations

import logging
import os
import re
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from dmaload.engines import EXTRA_CONFIG_KEYS, EngineKeys, LoaderConfig, weights

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def test_the_package_declares_both_engines_plugins() -> None:
    vllm = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    sglang = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert vllm.get("dmaload") == "dmaload.engines.vllm:register"
    assert sglang.get("dmaload") == "dmaload.engines.sglang:register"


def test_extra_config_takes_its_keys_and_leaves_the_engines() -> None:
    extra = {"window": "8M", "collective": False, "cache": "/run/x.sock", "mode": "buffered", "num_threads": 4}
    config = LoaderConfig.take(extra)
    assert (config.window, config.collective, config.cache, config.options) == (8 << 20, False, "/run/x.sock", {"mode": "buffered"})
    assert extra == {"num_threads": 4}  # the engine's own
    for bad, match in [({"window": 0}, "window"), ({"collective": 1}, "collective"), ({"cache": 3}, "cache"),
                       ({"chunk_size": "lots"}, "invalid size"), ({"window": True}, "window")]:
        with pytest.raises(ValueError, match=match):
            LoaderConfig.take(bad)


ENGINE = EngineKeys("Engine", kept={"track": bool}, refused={"threads_of_its_own": "its own reader"})


def test_extra_config_checks_every_key_and_value_when_it_is_read() -> None:
    # Each value a load would refuse fails here, where the config is read,
    # naming the key (before: only the names were checked, and a bad value
    # failed inside the first load).
    for bad, match in [({"mode": "fastest"}, "fastest"), ({"engine": "warp"}, "warp"), ({"to": "vram"}, "vram"),
                       ({"queue_depth": 100000}, "queue depth 100000"), ({"chunk_size": 0}, "chunk size 0"),
                       ({"threads": True}, "threads"), ({"verify": "yes"}, "verify")]:
        with pytest.raises(ValueError, match=match):
            LoaderConfig.take(dict(bad))
    # A key neither dmaload's nor the engine's: the error names it and lists
    # every key there is (dmaload's and the engine's own).
    with pytest.raises(ValueError, match="unknown model_loader_extra_config key 'windw'") as err:
        LoaderConfig.take({"windw": "8M"}, ENGINE)
    assert all(key in str(err.value) for key in (*EXTRA_CONFIG_KEYS, "track")), err.value
    with pytest.raises(ValueError, match="'threads_of_its_own' is refused with load format 'dmaload': its own reader"):
        LoaderConfig.take({"threads_of_its_own": 4}, ENGINE)
    with pytest.raises(ValueError, match="'track' takes a bool"):
        LoaderConfig.take({"track": "yes"}, ENGINE)
    extra = {"track": True, "window": "1M"}
    assert LoaderConfig.take(extra, ENGINE).window == 1 << 20
    assert extra == {"track": True}


def test_weights_yields_every_tensor_and_logs_a_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {f"w{i}": torch.randn(300 + i, 17, generator=g).to(torch.bfloat16) for i in range(6)}
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(tensors, path)
    log = logging.getLogger("test.engines")
    with caplog.at_level(logging.INFO, logger="test.engines"):
        got = {name: t.clone() for name, t in weights([str(path)], "cpu", LoaderConfig(), show_progress=False, log=log)}
    assert got.keys() == tensors.keys()
    assert all(got[n].equal(tensors[n]) for n in tensors)
    assert "dmaload: loaded 6 tensors" in caplog.text and "1 rank(s) shared the reads" in caplog.text


def _reads_of_checkpoint(text: str) -> float:
    (read,) = re.findall(r"this process read ([0-9.]+) GiB of the checkpoint", text)
    return float(read)


def test_the_summary_counts_the_checkpoints_bytes_not_the_processs_other_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The summary's "this process read X GiB" is what the load read of the
    checkpoint: not what else the process read meanwhile (before: every
    read of the process, /proc/self/io, so 0.020 GiB for a 0.0007 GiB
    model), nor nothing where the checkpoint came from the page cache."""
    g = torch.Generator().manual_seed(2)
    tensors = {f"w{i}": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(3)}  # 6 MiB
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(tensors, path)
    other = tmp_path / "other.bin"
    other.write_bytes(os.urandom(32 << 20))
    log = logging.getLogger("test.engines")

    def load(filter_: Any = None) -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="test.engines"):
            for name, _ in weights([str(path)], "cpu", LoaderConfig(options={"mode": "buffered"}), show_progress=False,
                                   log=log, tensor_filter=filter_):
                if name == "w0":  # the engine's own reads between tensors, from storage
                    fd = os.open(other, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        while os.read(fd, 1 << 20):
                            pass
                    finally:
                        os.close(fd)
        return caplog.text

    size = path.stat().st_size
    # The header and every tensor's bytes (windows start 4 KiB aligned).
    assert _reads_of_checkpoint(load()) == pytest.approx(size / 2**30, abs=1e-3)
    assert _reads_of_checkpoint(load()) == pytest.approx(size / 2**30, abs=1e-3)  # now from the page cache
    # A filter leaves the other tensors unread.
    assert _reads_of_checkpoint(load(["w1"])) == pytest.approx(size / 3 / 2**30, abs=1e-3)


def test_the_summary_says_which_files_the_cache_service_gave(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from test_cache import Service  # skips where the native CLI is not built

    for i in range(2):
        safetensors_torch.save_file({f"w{i}": torch.randn(256, 256)}, tmp_path / f"m{i}.safetensors")
    files = [str(p) for p in sorted(tmp_path.glob("*.safetensors"))]
    service = Service(tmp_path / "cache.sock")
    log = logging.getLogger("test.engines")
    try:
        with caplog.at_level(logging.INFO, logger="test.engines"):
            list(weights(files, "cpu", LoaderConfig(cache=str(service.socket)), show_progress=False, log=log))
    finally:
        service.stop()
    # The service read the files (a miss loads them there): this process none.
    assert "this process read 0.000 GiB of the checkpoint (2 of 2 file(s) from the model-cache service)" in caplog.text
