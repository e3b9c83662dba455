"""DmaloadModelLoader against vLLM's own DefaultModelLoader, at loader level.

Needs only vLLM's loader classes, not an engine: ci.sh runs it with the CPU
build the end-to-end tests use (setup-vllm.sh) and with the newest vLLM
release installed beside it (setup-vllm-next.sh), so a vLLM that changes
what happens around its safetensors reader is caught by one of them.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.config.load import LoadConfig  # noqa: E402
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: E402

from dmaload.engines import EXTRA_CONFIG_KEYS  # noqa: E402
from dmaload.engines.vllm import DmaloadModelLoader  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from tiny_llama import make, make_mixtral  # noqa: E402


def test_which_vllm() -> None:
    print(f"\nvLLM {vllm.__version__} at {Path(vllm.__file__).parent}")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make(root / "llama", layers=3, hidden=128, intermediate=256, shard_size="200KB"),
        "mixtral": make_mixtral(root / "mixtral", layers=2, experts=4, shard_size="150KB"),
    }


class _Model(torch.nn.Module):
    """What get_all_weights asks of a model: a second checkpoint under a
    prefix (a draft model's, say) and a predicate of unused weights, whose
    shards vLLM leaves unread."""

    def __init__(self, secondary: Path, unused: str) -> None:
        super().__init__()
        self.secondary_weights = [DefaultModelLoader.Source(str(secondary), None, prefix="draft.")]
        self.is_unused_checkpoint_weight = lambda name: unused in name


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def dmaload_log() -> Iterator[list[str]]:
    handler, log = _Lines(), logging.getLogger("vllm.dmaload")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)  # setLevel, not an assignment: it clears the logger's cached level checks
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _all_weights(loader: Any, model_dir: Path, model: Any) -> dict[str, Any]:
    config = SimpleNamespace(model=str(model_dir), revision=None)
    return {name: tensor.clone() for name, tensor in loader.get_all_weights(config, model)}


def _same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert sorted(ours) == sorted(theirs)
    different = [n for n in theirs if ours[n].dtype != theirs[n].dtype or not torch.equal(ours[n], theirs[n])]
    assert not different, different


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_get_all_weights_gives_what_vllms_default_loader_gives(
    models: dict[str, Path], name: str, dmaload_log: list[str]
) -> None:
    primary, secondary = models[name], models["mixtral" if name == "llama" else "llama"]
    model = _Model(secondary, unused="layers.1.")
    ours = _all_weights(DmaloadModelLoader(LoadConfig(load_format="dmaload")), primary, model)
    # vLLM's own, in the same process after ours: its reader is vLLM's.
    theirs = _all_weights(DefaultModelLoader(LoadConfig(load_format="safetensors")), primary, model)
    _same(ours, theirs)
    assert any(n.startswith("draft.") for n in theirs)  # the secondary source, prefixed
    # dmaload read both sources (one summary line each), vLLM's loader none.
    assert len(dmaload_log) == 2 and all("dmaload: loaded" in line for line in dmaload_log), dmaload_log
    if name == "llama":
        # vLLM's filter of unused weights ran before the read: the Llama's
        # shards holding only layer 1 were not read, so their tensors are
        # missing from both (those sharing a shard with used ones are read).
        vllms = DefaultModelLoader(LoadConfig(load_format="safetensors"))
        everything = _all_weights(vllms, primary, _Model(secondary, unused="-"))
        assert len(everything) > len(theirs), "the filter dropped no shard"


def test_a_step_vllm_runs_around_its_reader_runs_on_dmaloads_tensors(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's main branch passes the reader's tensors through a new step
    (decode_csf_scale_streams) before the prefix: a loader that re-implements
    _get_weights_iterator skips such a step. Here vLLM's method gains one
    (each tensor renamed and doubled, as a decoding step would replace it):
    dmaload's tensors go through it as vLLM's own do."""
    vllms = DefaultModelLoader._get_weights_iterator

    def with_a_new_step(self: Any, source: Any) -> Any:
        return ((f"decoded.{n}", t * 2) for n, t in vllms(self, source))

    monkeypatch.setattr(DefaultModelLoader, "_get_weights_iterator", with_a_new_step)
    model = torch.nn.Module()
    ours = _all_weights(DmaloadModelLoader(LoadConfig(load_format="dmaload")), models["llama"], model)
    theirs = _all_weights(DefaultModelLoader(LoadConfig(load_format="safetensors")), models["llama"], model)
    assert all(n.startswith("decoded.") for n in theirs)
    _same(ours, theirs)


def test_a_vllm_that_reads_its_files_elsewhere_is_refused(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where vLLM's _get_weights_iterator no longer calls its safetensors
    reader, the load fails naming it rather than being read by vLLM."""
    from safetensors.torch import load_file

    def elsewhere(self: Any, source: Any) -> Any:
        _, files, _, _ = self._prepare_weights(source.model_or_path, None, None, True, None)
        return ((n, t) for f in files for n, t in load_file(f).items())

    monkeypatch.setattr(DefaultModelLoader, "_get_weights_iterator", elsewhere)
    with pytest.raises(RuntimeError, match="did not call weight_utils.safetensors_weights_iterator"):
        _all_weights(DmaloadModelLoader(LoadConfig(load_format="dmaload")), models["llama"], torch.nn.Module())


def _loader(extra: dict[str, Any], **load_config: Any) -> DmaloadModelLoader:
    return DmaloadModelLoader(LoadConfig(load_format="dmaload", model_loader_extra_config=extra, **load_config))


def test_extra_config_is_checked_when_the_loader_is_made() -> None:
    loader = _loader({"window": "64M", "mode": "buffered", "enable_weights_track": True})
    assert loader.dmaload_config.window == 64 << 20
    assert loader.dmaload_config.options == {"mode": "buffered"}
    assert loader.enable_weights_track is True  # vLLM's key keeps its meaning
    # A misspelled key: named, with every key there is, under this format
    # (before: "Unexpected extra config keys for load format safetensors").
    with pytest.raises(ValueError, match="unknown model_loader_extra_config key 'windw' for load format 'dmaload'") as err:
        _loader({"windw": "64M"})
    assert all(key in str(err.value) for key in (*EXTRA_CONFIG_KEYS, "enable_weights_track")), err.value
    assert "safetensors" not in str(err.value)
    # A bad value fails here (before: inside the load).
    for bad, match in [({"mode": "fastest"}, "fastest"), ({"queue_depth": 0}, "queue depth 0"),
                       ({"window": 0}, "window"), ({"collective": "yes"}, "collective"),
                       ({"enable_weights_track": "yes"}, "enable_weights_track")]:
        with pytest.raises(ValueError, match=match):
            _loader(bad)
    # vLLM's keys that choose its own reader (accepted and ignored before).
    for key, value in [("enable_multithread_load", True), ("num_threads", 4)]:
        with pytest.raises(ValueError, match=f"'{key}' is refused with load format 'dmaload'"):
            _loader({key: value})
    with pytest.raises(ValueError, match="torchao"):
        _loader({}, safetensors_load_strategy="torchao")


def test_the_loader_keeps_vllms_load_config() -> None:
    """Everything of the LoadConfig but the format and dmaload's keys reaches
    vLLM's loader as given."""
    config = LoadConfig(load_format="dmaload", download_dir="/tmp/x", model_loader_extra_config={"window": "1M"})
    loader = DmaloadModelLoader(config)
    expected = dataclasses.replace(config, load_format="safetensors", model_loader_extra_config={})
    assert loader.load_config == expected


def test_a_verified_load_checks_every_shard_against_its_sums_file(models: dict[str, Path], tmp_path: Path) -> None:
    """`{"verify": true}`: an intact checkpoint with a SHA256SUMS beside it
    gives vLLM's own tensors; one byte of a shard changed fails the load
    (before: every verified load failed, "a load into the caller's memory is
    not verified"); no sums file is refused, naming `dmaload sums`."""
    import hashlib
    import shutil

    model = shutil.copytree(models["llama"], tmp_path / "llama")
    shards = sorted(model.glob("*.safetensors"))
    (model / "SHA256SUMS").write_text(
        "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in shards)
    )
    verified = _loader({"verify": True})
    ours = _all_weights(verified, model, torch.nn.Module())
    theirs = _all_weights(DefaultModelLoader(LoadConfig(load_format="safetensors")), model, torch.nn.Module())
    _same(ours, theirs)

    data = bytearray(shards[-1].read_bytes())
    data[-1] ^= 0xFF
    shards[-1].write_bytes(bytes(data))
    with pytest.raises(Exception, match="SHA-256 mismatch"):
        _all_weights(_loader({"verify": True}), model, torch.nn.Module())

    (model / "SHA256SUMS").unlink()
    with pytest.raises(Exception, match="dmaload sums"):
        _all_weights(_loader({"verify": True}), model, torch.nn.Module())


def test_an_s3_model_is_read_from_model_weights_as_vllm_keeps_it(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM keeps an object-storage model's URL in ``model_config.model_weights``
    and points ``model`` at a local directory of its config files: the
    loader reads the weights from the URL (a prefix without its ``/``, as
    vLLM passes it), against a real S3 server (Garage, as
    bindings/python/tests/test_object_store.py starts it), the same tensors
    as vLLM's own loader gives from the files on disk; then the same through
    the model-cache service, a miss and then a hit for every shard."""
    sys.path.insert(0, str(HERE.parents[1] / "bindings/python/tests"))
    from test_object_store import Garage, garage_binary

    binary = garage_binary()
    if binary is None:
        print("SKIP test_an_s3_model_is_read_from_model_weights_as_vllm_keeps_it: no garage binary")
        pytest.skip("no garage binary")
    (tmp_path / "garage").mkdir()
    garage = Garage(binary, tmp_path / "garage")
    try:
        monkeypatch.setenv("HOME", str(tmp_path))
        for name, value in garage.env().items():
            monkeypatch.setenv(name, value)
        for f in models["llama"].iterdir():
            if f.name.endswith((".safetensors", ".safetensors.index.json")):
                garage.put(f"llama/{f.name}", f.read_bytes())
        (tmp_path / "configs").mkdir()  # what vLLM pulled: no weights
        config = SimpleNamespace(model=str(tmp_path / "configs"), model_weights="s3://models/llama", revision=None)
        model = torch.nn.Module()
        loader = DmaloadModelLoader(LoadConfig(load_format="dmaload"))
        ours = {name: tensor.clone() for name, tensor in loader.get_all_weights(config, model)}
        theirs = _all_weights(DefaultModelLoader(LoadConfig(load_format="safetensors")), models["llama"], model)
        shards = len(list(models["llama"].glob("*.safetensors")))
        assert shards > 1
        _same(ours, theirs)
        # Through the model-cache service (`cache` in the extra config): the
        # service reads each shard with this process's grant once, and the
        # next load maps every shard from it.
        from test_cache import Service

        service = Service(tmp_path / "cache.sock")
        try:
            extra = {"cache": str(service.socket)}
            cached = DmaloadModelLoader(LoadConfig(load_format="dmaload", model_loader_extra_config=extra))
            for _ in range(2):
                _same({name: t.clone() for name, t in cached.get_all_weights(config, model)}, theirs)
            status = service.status()
            assert (status["misses"], status["hits"]) == (shards, shards), status
        finally:
            service.stop()
    finally:
        garage.stop()


def test_the_weights_key_takes_an_s3_url_only() -> None:
    """``weights`` (where an ``s3://`` model's weights are, its config files
    in MODEL) is the vLLM loader's own key: anything but an ``s3://`` URL is
    refused when the loader is made, and the key is named among the keys."""
    with pytest.raises(ValueError, match="weights must be an s3:// URL"):
        DmaloadModelLoader(LoadConfig(load_format="dmaload", model_loader_extra_config={"weights": "/models/x"}))
    with pytest.raises(ValueError, match="takes a str"):
        DmaloadModelLoader(LoadConfig(load_format="dmaload", model_loader_extra_config={"weights": 3}))
    with pytest.raises(ValueError, match="dmaload's for vLLM: weights"):
        DmaloadModelLoader(LoadConfig(load_format="dmaload", model_loader_extra_config={"wieghts": "s3://b/m/"}))
