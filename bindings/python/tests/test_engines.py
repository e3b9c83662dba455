"""What the serving-engine loaders share, without an engine installed (the
engines themselves: tests/engines, in vLLM's own environment)."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from dmaload.engines import LoaderConfig, weights

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
                       ({"chunk_size": "lots"}, "invalid size")]:
        with pytest.raises(ValueError, match=match):
            LoaderConfig.take(bad)


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
