"""The device path of dmaload.safetensors: each file through a staging ring
into one allocation per file. ``device="cpu"`` runs the same code without a
GPU (every dtype, odd sizes, tensors spanning slots, many per slot, sharded
models, errors mid-stream, truncation, a two-slot ring); the ``cuda`` tests
run where PyTorch sees a CUDA device and skip with the reason elsewhere."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dmaload
import dmaload.safetensors as dst
from dmaload import evict
from dmaload.safetensors import _device

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

RNG = np.random.default_rng(7)
TINY_RING: dict[str, Any] = {"staging_slots": 2, "staging_slot_size": "64K", "chunk_size": "16K"}


def _cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


needs_cuda = pytest.mark.skipif(_cuda_reason() is not None, reason=f"SKIP cuda: {_cuda_reason()}")


def _random(dtype: Any, shape: tuple[int, ...]) -> Any:
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(RNG.integers(0, 256, n, dtype=np.uint8))
    return (raw % 2).bool().reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Every dtype and odd sizes; a few tensors larger than a 64 KiB slot."""
    path = tmp_path_factory.mktemp("dev") / "m.safetensors"
    tensors: dict[str, Any] = {}
    for name in ["bool", "uint8", "int8", "int16", "float16", "bfloat16", "int32", "float32", "int64", "float64",
                 "complex64", "float8_e4m3fn", "float8_e5m2"]:  # fmt: skip
        dtype = getattr(torch, name, None)
        if dtype is not None:
            for shape in [(), (1,), (7,), (3, 5), (0,), (2, 3, 4)]:
                tensors[f"{name}_{'x'.join(map(str, shape)) or 'scalar'}"] = _random(dtype, shape)
    tensors.update({f"odd_{n}": _random(torch.uint8, (n,)) for n in (1, 3, 4095, 65537)})
    tensors["spans_slots"] = _random(torch.float32, (333, 257))  # 342 KiB: five slots
    st_torch.save_file(tensors, path)
    return path, tensors


def _same(ours: Any, theirs: Any, device: str) -> None:
    assert ours.device.type == torch.device(device).type
    assert ours.dtype == theirs.dtype and tuple(ours.shape) == tuple(theirs.shape)
    a = ours.cpu().contiguous().reshape(-1).view(torch.uint8)
    b = theirs.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, b)


def _device_report(path: Path, **options: Any) -> dmaload.LoadReport:
    evict(path)
    return _device.load_files([path], "cpu", None, {**TINY_RING, **options})[0].report


def test_auto_mode_copies_a_cached_file_from_the_page_cache(model: tuple[Path, dict[str, Any]]) -> None:
    path, expected = model
    path.read_bytes()
    files = _device.load_files([path], "cpu", None, dict(TINY_RING))
    assert any(f.to == "page cache" for f in files[0].report.fallbacks), files[0].report.fallbacks
    _same(files[0].torch("spans_slots"), expected["spans_slots"], "cpu")


def _load(path: Path, device: str, **options: Any) -> dict[str, Any]:
    files = _device.load_files([path], device, None, options)
    return {name: files[0].torch(name) for name in files[0].tensors}


def test_staged_host_load_is_bit_exact_through_a_two_slot_ring(model: tuple[Path, dict[str, Any]]) -> None:
    path, expected = model
    for engine in ("uring-fixed", "pread-pool"):
        evict(path)  # else auto mode copies it from the page cache with the pool
        out = _load(path, "cpu", engine=engine, **TINY_RING)
        assert out and _device_report(path, engine=engine).engine == engine
        assert set(out) == set(expected)
        for name, t in expected.items():
            _same(out[name], t, "cpu")


def test_staged_load_measures_the_page_cache_only_when_asked(model: tuple[Path, dict[str, Any]]) -> None:
    path, _ = model
    assert _device_report(path).page_cache is None
    # Buffered reads keep the data section in the page cache.
    pc = _device_report(path, mode="buffered", measure_page_cache=True).page_cache
    assert isinstance(pc, dmaload.PageCacheResidency) and pc.fraction > 0.99


def test_staged_tensors_are_views_of_one_allocation(model: tuple[Path, dict[str, Any]]) -> None:
    path, _ = model
    files = _device.load_files([path], "cpu", None, dict(TINY_RING))
    f = files[0]
    base = f._torch_base
    assert base.numel() == os.path.getsize(path) - f.data_start
    t = f.torch("float32_3x5")
    assert t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert f.report.destination.startswith("staging ring (2 x 65536")


def test_staged_sharded_model(tmp_path: Path) -> None:
    expected = {f"layer{i}.w": _random(torch.bfloat16, (i + 1, 1001)) for i in range(6)}
    weight_map = {}
    for shard in range(3):
        name = f"model-{shard + 1:05d}-of-00003.safetensors"
        part = {k: v for i, (k, v) in enumerate(expected.items()) if i % 3 == shard}
        st_torch.save_file(part, tmp_path / name)
        weight_map.update({k: name for k in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    paths, _ = dst.shard_paths(tmp_path)
    calls: list[tuple[int, int]] = []
    files = _device.load_files(paths, "cpu", lambda d, t: calls.append((d, t)), dict(TINY_RING))
    got = {name: f.torch(name) for f in files for name in f.tensors}
    for name, t in expected.items():
        _same(got[name], t, "cpu")
    total = sum(f.data_len for f in (dmaload._dmaload.open_safetensors(os.fspath(p)) for p in paths))
    assert calls[-1] == (total, total)


def test_truncated_file_raises_and_returns_nothing(model: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, _ = model
    cut = tmp_path / "cut.safetensors"
    data = path.read_bytes()
    cut.write_bytes(data)
    file = dmaload._dmaload.open_safetensors(os.fspath(cut))
    base = torch.empty(file.data_len, dtype=torch.uint8)
    with open(cut, "r+b") as f:
        f.truncate(len(data) - 100_000)  # after the header was read: mid-stream
    with pytest.raises(OSError) as info:
        dmaload._dmaload._load_staged(
            [file], [base.numpy()], -1, options={"staging_slots": 2, "staging_slot_size": 65536, "chunk_size": 16384}
        )
    assert str(cut) in str(info.value) and "offset" in str(info.value)
    # A header that promises more than the file holds is refused before reading.
    with pytest.raises(dmaload.SafetensorError):
        _load(cut, "cpu")


def test_a_raising_progress_callback_stops_the_staged_load(model: tuple[Path, dict[str, Any]]) -> None:
    path, _ = model
    seen = []

    def boom(done: int, total: int) -> None:
        seen.append(done)
        raise KeyError("stop")

    with pytest.raises(KeyError):
        _device.load_files([path], "cpu", boom, dict(TINY_RING))
    assert len(seen) == 1


def test_bad_devices_are_refused_with_the_reason(model: tuple[Path, dict[str, Any]]) -> None:
    path, _ = model
    with pytest.raises(ValueError, match="cpu' or 'cuda:N"):
        dst.load_file(path, device="meta", framework="pt")
    if _cuda_reason() is not None:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            dst.load_file(path, device="cuda:0", framework="pt")
    with pytest.raises(TypeError, match="unknown load option"):
        _device.load_files([path], "cpu", None, {"slots": 3})
    with pytest.raises(TypeError, match=r"device=<object .*> is not a device PyTorch knows"):
        dst.load_file(path, device=object(), framework="pt")


def test_device_none_is_the_cpu_as_in_safetensors(model: tuple[Path, dict[str, Any]]) -> None:
    path, expected = model
    out = dst.load_file(path, device=None, framework="pt")
    for name, t in expected.items():
        _same(out[name], t, "cpu")
    with dst.safe_open(path, framework="np", device=None) as f:
        assert f.keys() == sorted(expected)


def test_host_destinations_must_be_writable_buffers_of_the_right_size(model: tuple[Path, dict[str, Any]]) -> None:
    path, _ = model
    file = dmaload._dmaload.open_safetensors(os.fspath(path))
    for bad in (bytes(file.data_len), bytearray(file.data_len - 1), 12345):
        with pytest.raises((ValueError, TypeError, BufferError)):
            dmaload._dmaload._load_staged([file], [bad], -1)
    good = bytearray(file.data_len)
    dmaload._dmaload._load_staged([file], [good], -1)
    assert bytes(good) == path.read_bytes()[-file.data_len :]
    # Each destination becomes a `&mut [u8]`: two sharing bytes would alias.
    both = np.zeros(file.data_len + 1, dtype=np.uint8)
    for first, second in ((good, good), (both[:-1], both[1:])):
        with pytest.raises(ValueError, match="overlap"):
            dmaload._dmaload._load_staged([file, file], [first, second], -1)


@needs_cuda
def test_cuda_load_file_is_bit_exact(model: tuple[Path, dict[str, Any]]) -> None:
    path, expected = model
    for options in ({}, TINY_RING):
        out = dst.load_file(path, device="cuda:0", framework="pt", **options)
        for name, t in expected.items():
            _same(out[name], t, "cuda")
    with dst.safe_open(path, framework="pt", device="cuda") as f:
        _same(f.get_tensor("spans_slots"), expected["spans_slots"], "cuda")
        assert f.reports[0].destination.startswith("staging ring")


@needs_cuda
def test_cuda_concurrent_loads_and_current_device_unchanged(model: tuple[Path, dict[str, Any]]) -> None:
    path, expected = model
    before = torch.cuda.current_device()
    results: list[dict[str, Any]] = []
    threads = [
        threading.Thread(target=lambda: results.append(dst.load_file(path, device="cuda:0", framework="pt")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and torch.cuda.current_device() == before
    for out in results:
        _same(out["spans_slots"], expected["spans_slots"], "cuda")


@needs_cuda
def test_cuda_out_of_range_device_and_too_large_model(model: tuple[Path, dict[str, Any]]) -> None:
    path, _ = model
    with pytest.raises(ValueError, match="CUDA device"):
        dst.load_file(path, device=f"cuda:{torch.cuda.device_count()}", framework="pt")
    # A device pointer that is not device memory is refused before reading.
    file = dmaload._dmaload.open_safetensors(os.fspath(path))
    host = torch.empty(file.data_len, dtype=torch.uint8)
    with pytest.raises(OSError):
        dmaload._dmaload._load_staged([file], [host.data_ptr()], 0)


def test_the_staging_ring_is_kept_for_the_next_load(model: tuple[Path, dict[str, Any]]) -> None:
    import threading

    from dmaload.safetensors import release_staging

    path, expected = model
    release_staging()
    _device.load_files([path], "cpu", None, dict(TINY_RING))
    # Two slots of 64 KiB were kept; a load with another geometry replaces them.
    assert release_staging() == 2 * (64 << 10)
    assert release_staging() == 0
    _device.load_files([path], "cpu", None, dict(TINY_RING))
    _device.load_files([path], "cpu", None, {**TINY_RING, "staging_slots": 3})
    assert release_staging() == 3 * (64 << 10)
    # Loads at once: each has a ring of its own, all bytes right, one ring kept.
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            (file,) = _device.load_files([path], "cpu", None, dict(TINY_RING))
            results.append({name: file.torch(name) for name in expected})
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 3
    for tensors in results:
        for name, want in expected.items():
            _same(tensors[name], want, "cpu")
    assert release_staging() == 2 * (64 << 10)
