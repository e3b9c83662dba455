"""dmaload.safetensors against files written by the safetensors package."""

from __future__ import annotations

import gc
import json
import struct
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dmaload
import dmaload.safetensors as dst

st_numpy = pytest.importorskip("safetensors.numpy")
torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
import safetensors  # noqa: E402

RNG = np.random.default_rng(42)

NUMPY_DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "float16", "uint32", "int32", "float32",
                "uint64", "int64", "float64", "complex64"]  # fmt: skip
SHAPES: list[tuple[int, ...]] = [(), (1,), (7,), (3, 5), (2, 3, 4), (0,), (4, 0, 2), (1, 1, 1, 1)]


def _random_numpy(dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    n = int(np.prod(shape))
    raw = RNG.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8)
    if dtype == "bool":
        return (raw % 2).astype(bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def _torch_bytes(t: Any) -> bytes:
    # A fresh dense copy: `contiguous()` keeps the stride of a size-1 axis
    # (a slice with a step), which `view` as bytes refuses.
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return bytes(dense.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def _same_numpy(ours: np.ndarray[Any, Any], theirs: np.ndarray[Any, Any]) -> None:
    assert ours.shape == theirs.shape
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    assert ours.tobytes() == theirs.tobytes()


def _same_torch(ours: Any, theirs: Any) -> None:
    assert ours.dtype == theirs.dtype and tuple(ours.shape) == tuple(theirs.shape)
    assert _torch_bytes(ours) == _torch_bytes(theirs)


@pytest.fixture(scope="module")
def numpy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("np") / "all.safetensors"
    tensors = {f"{dt}_{'x'.join(map(str, s)) or 'scalar'}": _random_numpy(dt, s) for dt in NUMPY_DTYPES for s in SHAPES}
    # Odd sizes: byte tensors of odd lengths between wider ones.
    tensors.update({f"odd_{n}": _random_numpy("uint8", (n,)) for n in (1, 3, 5, 7, 9, 4095)})
    st_numpy.save_file(tensors, path, metadata={"format": "np", "note": "ünïcode ✓"})
    return path


TORCH_DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "float16", "bfloat16", "int32", "uint32", "float32",
                "int64", "uint64", "float64", "complex64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz", "float8_e8m0fnu"]  # fmt: skip


def _random_torch(dtype: Any, shape: tuple[int, ...]) -> Any:
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(RNG.integers(0, 256, n, dtype=np.uint8))
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.fixture(scope="module")
def torch_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pt") / "all.safetensors"
    tensors = {}
    for name in TORCH_DTYPES:
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        for s in SHAPES:
            tensors[f"{name}_{'x'.join(map(str, s)) or 'scalar'}"] = _random_torch(dtype, s)
    if hasattr(torch, "float4_e2m1fn_x2"):
        tensors["f4_packed"] = _random_torch(torch.uint8, (3, 4)).view(torch.float4_e2m1fn_x2)
    st_torch.save_file(tensors, path, metadata={"format": "pt"})
    return path


def test_numpy_bit_for_bit(numpy_file: Path) -> None:
    theirs = st_numpy.load_file(numpy_file)
    ours = dst.load_file(numpy_file)
    assert set(ours) == set(theirs)
    for name in theirs:
        _same_numpy(ours[name], theirs[name])


def test_numpy_compat_module(numpy_file: Path) -> None:
    from dmaload.safetensors.numpy import load_file

    ours = load_file(numpy_file)
    theirs = st_numpy.load_file(numpy_file)
    for name in theirs:
        _same_numpy(ours[name], theirs[name])


def test_torch_bit_for_bit(numpy_file: Path, torch_file: Path) -> None:
    for path in (numpy_file, torch_file):
        ours = dst.load_file(path, framework="pt")
        with safetensors.safe_open(path, framework="pt") as f:
            names = list(f.keys())
            for name in names:
                if name == "f4_packed":
                    continue  # safetensors.torch cannot load F4; checked below
                _same_torch(ours[name], f.get_tensor(name))
        assert set(ours) == set(names)


def test_torch_compat_module(torch_file: Path) -> None:
    from dmaload.safetensors.torch import load_file

    ours = load_file(torch_file)
    theirs = st_torch.load_file(torch_file)
    for name, t in theirs.items():
        _same_torch(ours[name], t)


def test_f4_is_packed_pairs(torch_file: Path) -> None:
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch has no float4_e2m1fn_x2")
    with dst.safe_open(torch_file, "pt") as f:
        info = f.tensor_info("f4_packed")
        assert info.dtype == "F4" and info.shape == (3, 8)
        t = f.get_tensor("f4_packed")
        assert t.dtype == torch.float4_e2m1fn_x2 and tuple(t.shape) == (3, 4)
    with dst.safe_open(torch_file, "np") as g:
        raw = g.get_tensor("f4_packed")
        assert raw.dtype == np.uint8 and raw.shape == (12,)
        assert raw.tobytes() == _torch_bytes(t)


def test_bf16_and_f8_to_numpy(torch_file: Path) -> None:
    theirs = st_torch.load_file(torch_file)
    ours = dst.load_file(torch_file, framework="np")
    try:
        import ml_dtypes  # noqa: F401

        has_ml = True
    except ImportError:
        has_ml = False
    for name, t in theirs.items():
        a = ours[name]
        if name.startswith("bfloat16"):
            assert a.dtype.name == ("bfloat16" if has_ml else "uint16")
        if name.startswith("float8"):
            assert a.dtype.itemsize == 1 and (has_ml or a.dtype == np.uint8)
        if name != "f4_packed":
            assert a.shape == tuple(t.shape), name
        assert a.tobytes() == _torch_bytes(t), name


def test_bf16_uint16_fallback_without_ml_dtypes(torch_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import now fails
    ours = dst.load_file(torch_file)
    theirs = st_torch.load_file(torch_file)
    a = ours["bfloat16_3x5"]
    assert a.dtype == np.uint16
    assert a.tobytes() == _torch_bytes(theirs["bfloat16_3x5"])
    assert ours["float8_e4m3fn_7"].dtype == np.uint8


def test_safe_open_api(numpy_file: Path) -> None:
    with safetensors.safe_open(numpy_file, framework="np") as theirs, dst.safe_open(numpy_file, "np") as ours:
        assert ours.keys() == list(theirs.keys())
        assert ours.metadata() == theirs.metadata() == {"format": "np", "note": "ünïcode ✓"}
        for name in theirs.keys():
            _same_numpy(ours.get_tensor(name), theirs.get_tensor(name))
        assert len(ours) == len(theirs.keys()) and "odd_3" in ours
        with pytest.raises(KeyError):
            ours.get_tensor("nope")
        assert ours.reports[0].bytes == numpy_file.stat().st_size
    with pytest.raises(ValueError):
        ours.keys()


def test_get_slice_matches_safetensors(numpy_file: Path) -> None:
    # Keys safetensors' slices take (it refuses negative indices; ours take
    # whatever the framework's indexing does).
    keys: list[Any] = [slice(None), slice(1, 3), slice(None, None, 2), 1, (slice(None), slice(0, 2)), (..., 0)]
    for framework in ("np", "pt"):
        with safetensors.safe_open(numpy_file, framework=framework) as theirs, dst.safe_open(numpy_file, framework) as ours:
            for name in theirs.keys():
                t, o = theirs.get_slice(name), ours.get_slice(name)
                assert (o.get_shape(), o.get_dtype()) == (t.get_shape(), t.get_dtype()), name
                for key in keys:
                    try:
                        expected = t[key]
                    except Exception:  # an index past this tensor's rank or size
                        continue
                    got = o[key]
                    if framework == "np":
                        _same_numpy(got, expected)
                    else:
                        assert got.shape == expected.shape and got.dtype == expected.dtype, (name, key)
                        assert _torch_bytes(got) == _torch_bytes(expected), (name, key)
    with dst.safe_open(numpy_file) as f:
        assert np.array_equal(f.get_slice("float32_3x5")[-1], f.get_tensor("float32_3x5")[-1])


def test_errors_are_safetensors_errors_and_slices_refuse_what_safetensors_refuses(numpy_file: Path) -> None:
    """Code written for safetensors catches ours: our SafetensorError is
    also safetensors', a closed file raises it, and out-of-range slices
    raise it with safetensors' messages where NumPy would clamp (for NumPy
    slices, as safetensors' checks apply there; its PyTorch slices index
    as PyTorch does)."""
    assert issubclass(dmaload.SafetensorError, safetensors.SafetensorError)
    assert issubclass(dmaload.SafetensorError, ValueError)
    with safetensors.safe_open(numpy_file, framework="np") as theirs, dst.safe_open(numpy_file) as ours:
        keys: list[Any] = [
            (slice(2, None), 20),
            (slice(None), slice(None, 20)),
            slice(None, 20),
            slice(20, 30),
            (..., 20),
            (slice(None, None, 2), 20),
            (-1, slice(None, 20)),
            [0, 1],
            (0, -6),
        ]
        for key in keys:
            with pytest.raises(safetensors.SafetensorError) as expected:
                theirs.get_slice("float32_3x5")[key]
            with pytest.raises(safetensors.SafetensorError) as got:
                ours.get_slice("float32_3x5")[key]
            assert str(got.value) == str(expected.value), key
    with pytest.raises(safetensors.SafetensorError, match="closed"):
        ours.keys()


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_safetensors_backend_is_accepted_and_changes_nothing(numpy_file: Path, backend: str) -> None:
    with dst.safe_open(numpy_file, backend=backend) as f:  # type: ignore[arg-type]
        names = f.keys()
    assert names == safetensors.safe_open(numpy_file, framework="np").keys()
    assert sorted(dst.load_file(numpy_file, backend=backend)) == names  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be"):
        dst.load_file(numpy_file, backend="sideways")  # type: ignore[arg-type]


def test_all_tensors_are_views_of_one_buffer(numpy_file: Path) -> None:
    with dst.safe_open(numpy_file) as f:
        (buf,) = f.buffers
        base = np.frombuffer(buf, dtype=np.uint8)
        lo = base.__array_interface__["data"][0]
        hi = lo + base.nbytes
        tensors = f.get_tensors()
        del base
    for name, a in tensors.items():
        if a.size:
            ptr = a.__array_interface__["data"][0]
            assert lo <= ptr and ptr + a.nbytes <= hi, name
            assert np.shares_memory(a, np.frombuffer(buf, dtype=np.uint8)), name
    pt = dst.load_file(numpy_file, framework="pt")
    ptrs = [t.untyped_storage().data_ptr() for t in pt.values() if t.numel()]
    assert len(set(ptrs)) == 1  # one storage for the whole file


def test_tensors_keep_the_buffer_alive(numpy_file: Path) -> None:
    f = dst.safe_open(numpy_file)
    buf_ref = weakref.ref(f.buffers[0])
    a = f.get_tensor("float32_3x5")
    expected = a.copy()
    f.close()
    del f
    gc.collect()
    buf = buf_ref()
    assert buf is not None and not buf.closed
    with pytest.raises(BufferError):
        buf.close()  # the array still views it
    del buf
    np.testing.assert_array_equal(a, expected)
    del a
    gc.collect()
    assert buf_ref() is None


def test_torch_tensors_keep_the_buffer_alive(numpy_file: Path) -> None:
    f = dst.safe_open(numpy_file, "pt")
    buf = f.buffers[0]
    t = f.get_tensor("int64_2x3x4")
    expected = t.clone()
    f.close()
    del f
    gc.collect()
    with pytest.raises(BufferError):
        buf.close()
    assert torch.equal(t, expected)
    del t
    gc.collect()
    buf.close()


def test_writes_through_a_tensor_are_visible_in_the_buffer(numpy_file: Path) -> None:
    with dst.safe_open(numpy_file) as f:
        a = f.get_tensor("uint8_7")
        _, _, _, begin, _ = f.tensor_info("uint8_7")
        buf = f.buffers[0]
        header_len = struct.unpack("<Q", bytes(memoryview(buf)[:8]))[0]
        a[0] = 0xAB
        assert memoryview(buf)[8 + header_len + begin] == 0xAB


def _write_raw(path: Path, header: dict[str, Any], data: bytes, pad: int = 8) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % pad)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_unaligned_offsets(tmp_path: Path) -> None:
    """A float32 tensor at an odd offset (never written by safetensors, valid
    all the same): NumPy views it in place, PyTorch gets an aligned copy."""
    values = np.arange(6, dtype="<f4")
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [3, 27]},
        "h": {"dtype": "F16", "shape": [1], "data_offsets": [27, 29]},
    }
    path = tmp_path / "odd.safetensors"
    for pad in (1, 8):  # also an odd header length
        _write_raw(path, header, b"\x01\x02\x03" + values.tobytes() + np.float16(1.5).tobytes(), pad=pad)
        out = dst.load_file(path)
        np.testing.assert_array_equal(out["w"], values.reshape(2, 3))
        assert out["h"][0] == np.float16(1.5)
        pt = dst.load_file(path, framework="pt")
        assert torch.equal(pt["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
        theirs = st_numpy.load_file(path)
        _same_numpy(out["w"], theirs["w"])


def test_f6_is_raw_bytes(tmp_path: Path) -> None:
    path = tmp_path / "f6.safetensors"
    _write_raw(path, {"q": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, b"\x10\x20\x30")
    for fw in ("np", "pt"):
        q = dst.load_file(path, framework=fw)["q"]  # type: ignore[arg-type]
        assert bytes(q.numpy() if fw == "pt" else q) == b"\x10\x20\x30"


def _model(tmp: Path, shards: int) -> dict[str, np.ndarray[Any, Any]]:
    everything: dict[str, np.ndarray[Any, Any]] = {}
    weight_map = {}
    for i in range(shards):
        part = {f"layer{i}.{k}": _random_numpy("float32", (16, 8)) for k in ("q", "k", "v")}
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        st_numpy.save_file(part, tmp / name, metadata={"format": "np"})
        weight_map.update({k: name for k in part})
        everything.update(part)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return everything


def test_sharded_model_by_index_and_directory(tmp_path: Path) -> None:
    expected = _model(tmp_path, 5)
    for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
        for concurrency in (1, 3):
            out = dst.load_file(path, concurrency=concurrency)
            assert set(out) == set(expected)
            for k, v in expected.items():
                _same_numpy(out[k], v)
    (tmp_path / "model.safetensors.index.json").unlink()
    assert set(dst.load_file(tmp_path)) == set(expected)  # all *.safetensors of the directory
    # A directory (or a link to one) named like an index is not an index:
    # its own files are not the model's, and a link to "." loops.
    (tmp_path / "other.safetensors.index.json").mkdir()
    st_numpy.save_file({"other": np.zeros(2, np.float32)}, tmp_path / "other.safetensors.index.json" / "x.safetensors")
    assert set(dst.load_file(tmp_path)) == set(expected)
    (tmp_path / "other.safetensors.index.json" / "x.safetensors").unlink()
    (tmp_path / "other.safetensors.index.json").rmdir()
    (tmp_path / "loop.safetensors.index.json").symlink_to(".")
    assert set(dst.load_file(tmp_path)) == set(expected)


def test_a_directory_of_several_indexes_asks_which(tmp_path: Path) -> None:
    # A diffusers model: one index per variant, no model.safetensors.index.json.
    expected = _model(tmp_path, 2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / "model.safetensors.index.json").unlink()
    for variant in ("diffusion_pytorch_model", "diffusion_pytorch_model.fp16"):
        (tmp_path / f"{variant}.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(dmaload.SafetensorError, match=r"2 index files \(diffusion_pytorch_model\.fp16\.s") as info:
        dst.load_file(tmp_path)
    assert "pass the index to load" in str(info.value)
    assert set(dst.load_file(tmp_path / "diffusion_pytorch_model.safetensors.index.json")) == set(expected)


def test_sharded_progress_sums_files(tmp_path: Path) -> None:
    _model(tmp_path, 4)
    total = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    calls: list[tuple[int, int]] = []
    dst.load_file(tmp_path, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls)


def test_sharded_errors(tmp_path: Path) -> None:
    _model(tmp_path, 2)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["layer0.q"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(dmaload.SafetensorError, match="layer0.q"):
        dst.load_file(tmp_path)
    data["weight_map"]["layer0.q"] = "../escape.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(dmaload.SafetensorError, match="outside"):
        dst.load_file(index)
    # Each is SafetensorError naming the index, never what json.loads raises
    # (RecursionError for deep nesting, ValueError for a huge int).
    deep = "[" * 100_000 + "]" * 100_000
    for text in ("{not json", deep, '{"weight_map": {"a": "x"}, "n": ' + "9" * 5000 + "}", b"\xff".decode("latin-1")):
        index.write_text(text, encoding="latin-1")
        with pytest.raises(dmaload.SafetensorError, match=f"{index}: invalid index JSON"):
            dst.load_file(index)
    index.unlink()
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    st_numpy.save_file({"layer0.q": np.zeros(2, np.float32)}, tmp_path / "dup.safetensors")
    with pytest.raises(dmaload.SafetensorError, match="both"):
        dst.load_file(tmp_path)
    with pytest.raises(FileNotFoundError):
        dst.load_file(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        dst.load_file(tmp_path / "empty")


def test_an_index_larger_than_the_limit_is_not_read(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    with open(index, "wb") as f:
        f.truncate(dst.MAX_INDEX_LEN + 1)  # sparse: no disk, no memory
    with pytest.raises(dmaload.SafetensorError, match=f"{index}: the index exceeds the limit"):
        dst.load_file(tmp_path)


def test_framework_and_device_checks(numpy_file: Path) -> None:
    with pytest.raises(ValueError, match="framework"):
        dst.load_file(numpy_file, framework="jax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu"):
        dst.load_file(numpy_file, device="cuda")
    out = dst.load_file(numpy_file, device="cpu", framework="torch")
    assert out["float32_3x5"].device.type == "cpu"


def test_load_releases_the_gil(tmp_path: Path) -> None:
    """Concurrent safetensors loads from two Python threads both finish."""
    path = tmp_path / "m.safetensors"
    st_numpy.save_file({"w": _random_numpy("float32", (1024, 1024))}, path)
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(len(dst.load_file(path)))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1, 1, 1, 1]


def test_read_header_only(numpy_file: Path) -> None:
    from dmaload import _dmaload

    header = _dmaload.read_safetensors_header(numpy_file)
    assert header.metadata == {"format": "np", "note": "ünïcode ✓"}
    assert header.data_start % 8 == 0 and len(header.tensors) > 50
    offsets = [(t.begin, t.end) for t in header.tensors]
    assert offsets == sorted(offsets)
    assert header.data_len == numpy_file.stat().st_size - header.data_start
    dtypes = dict(_dmaload.safetensors_dtypes())
    assert dtypes["BF16"] == 16 and dtypes["F4"] == 4 and len(dtypes) == 22


def test_header_crosses_as_typed_records(tmp_path: Path) -> None:
    """Every way the native module gives a header gives the same
    ``Header`` of ``TensorInfo`` records, with Python types throughout, and
    the values the safetensors package reads from the file."""
    from dmaload import _dmaload

    path = tmp_path / "h.safetensors"
    st_numpy.save_file(
        {"b": np.zeros((2, 3), np.float32), "a": np.zeros(5, np.uint8), "s": np.zeros((), np.int64)},
        path,
        metadata={"k": "v"},
    )
    data = path.read_bytes()
    json_len = struct.unpack("<Q", data[:8])[0]
    listed = {k: v for k, v in json.loads(data[8 : 8 + json_len]).items() if k != "__metadata__"}

    read = _dmaload.read_safetensors_header(path)
    parsed = _dmaload.parse_safetensors_header(data)
    [(buf, loaded)] = _dmaload.load_safetensors([str(path)])
    file = _dmaload.open_safetensors(str(path))
    opened = file.header
    assert read == parsed == loaded == opened
    for header in (read, parsed, loaded, opened):
        assert type(header) is dst.Header
        assert type(header.tensors) is tuple and type(header.data_start) is int
        assert header.data_start == 8 + json_len
        assert header.metadata == {"k": "v"} and type(header.metadata) is dict
        assert header.data_len == len(data) - header.data_start == file.data_len
        # File order: the order of the data, not of the names.
        assert [t.name for t in header.tensors] == sorted(listed, key=lambda k: listed[k]["data_offsets"])
        for t in header.tensors:
            assert type(t) is dst.TensorInfo
            assert type(t.name) is str and type(t.dtype) is str and type(t.begin) is int and type(t.end) is int
            assert type(t.shape) is tuple and all(type(d) is int for d in t.shape)
            assert t.dtype == listed[t.name]["dtype"]
            assert list(t.shape) == listed[t.name]["shape"]
            assert [t.begin, t.end] == listed[t.name]["data_offsets"]
            assert t.nbytes == t.end - t.begin
    by_name = {t.name: t for t in read.tensors}
    assert by_name["b"] == dst.TensorInfo("b", "F32", (2, 3), by_name["b"].begin, by_name["b"].begin + 24)
    assert by_name["s"].shape == () and by_name["s"].nbytes == 8
    # Records are frozen.
    with pytest.raises(AttributeError):
        by_name["b"].begin = 0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        read.data_start = 0  # type: ignore[misc]
    del buf

    empty = _dmaload.parse_safetensors_header(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    assert empty == dst.Header(tensors=(), metadata=None, data_start=10) and empty.data_len == 0


def test_tensor_info_is_a_record_that_unpacks(numpy_file: Path) -> None:
    from dmaload import _dmaload

    data_start = _dmaload.read_safetensors_header(numpy_file).data_start
    with dst.safe_open(numpy_file) as f:
        info = f.tensor_info("float32_3x5")
        assert isinstance(info, dst.TensorInfo)
        assert (info.name, info.dtype, info.shape) == ("float32_3x5", "F32", (3, 5))
        assert info.nbytes == info.end - info.begin == 60
        # It unpacks like the tuple earlier versions returned.
        name, dtype, shape, begin, end = info
        assert (name, dtype, shape, begin, end) == (info.name, info.dtype, info.shape, info.begin, info.end)
        assert tuple(info) == (name, dtype, shape, begin, end)
        raw = bytes(memoryview(f.buffers[0])[data_start + begin : data_start + end])
        assert raw == f.get_tensor(name).tobytes()
    assert set(dst.__all__) >= {"Header", "TensorInfo"}


def test_index_weight_maps_are_checked_against_the_files(tmp_path: Path) -> None:
    _model(tmp_path, 2)
    index = tmp_path / "model.safetensors.index.json"
    good = json.loads(index.read_text())

    def with_map(weight_map: dict[str, str]) -> Path:
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return index

    # A shard of the same name in another directory is not the shard.
    (tmp_path / "sub").mkdir()
    shard2 = "model-00002-of-00002.safetensors"
    st_numpy.save_file({"other": np.zeros(2, np.float32)}, tmp_path / "sub" / shard2)
    moved = dict(good["weight_map"])
    moved.update({k: f"sub/{shard2}" for k, v in good["weight_map"].items() if v == shard2})
    with pytest.raises(dmaload.SafetensorError, match="no such tensor") as info:
        dst.load_file(with_map(moved))
    # The error names the file that lacks the tensor by its path.
    assert str(tmp_path / "sub" / shard2) in str(info.value), info.value
    # An empty weight map is an error, not an empty model.
    with pytest.raises(dmaload.SafetensorError, match="empty weight_map"):
        dst.load_file(with_map({}))
    # A tensor in a shard that the map does not list.
    partial = {k: v for k, v in good["weight_map"].items() if k != "layer1.v"}
    with pytest.raises(dmaload.SafetensorError, match="does not list"):
        dst.load_file(with_map(partial))
    # A shard that does not exist.
    missing = dict(good["weight_map"], **{"layer0.q": "model-00009-of-00002.safetensors"})
    with pytest.raises(FileNotFoundError):
        dst.load_file(with_map(missing))
    assert set(dst.load_file(with_map(good["weight_map"]))) == set(good["weight_map"])


def test_shards_that_disagree_fail_from_their_headers_before_loading(tmp_path: Path) -> None:
    _model(tmp_path, 2)
    index = tmp_path / "model.safetensors.index.json"
    good = json.loads(index.read_text())["weight_map"]
    shard1, shard2 = sorted(set(good.values()))
    loaded: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        loaded.append((done, total))

    def load_fails(path: Path, match: str) -> None:
        with pytest.raises(dmaload.SafetensorError, match=match):
            dst.load_file(path, progress=progress)
        assert not loaded, f"{len(loaded)} progress calls before the error"

    # The index puts a tensor in the wrong shard, or leaves one out.
    wrong = dict(good, **{next(k for k, v in good.items() if v == shard1): shard2})
    index.write_text(json.dumps({"weight_map": wrong}))
    load_fails(index, "that file has no such tensor")
    index.write_text(json.dumps({"weight_map": dict(list(good.items())[1:])}))
    load_fails(index, "does not list")
    # Two shards of a directory (no index) hold the same tensor.
    index.unlink()
    first = st_numpy.load_file(tmp_path / shard1)
    st_numpy.save_file(dict(first, extra=np.zeros(1, np.float32)), tmp_path / "copy.safetensors")
    load_fails(tmp_path, "is in both")
    assert set(dst.load_file(tmp_path / shard2, progress=progress)) == {k for k, v in good.items() if v == shard2}
    assert loaded, "a load reports progress"


def test_index_shard_names_are_checked_before_loading(tmp_path: Path) -> None:
    """Issue 7: every bad weight_map value is an error naming the tensor and
    the value, raised before any shard is loaded."""
    _model(tmp_path, 2)
    index = tmp_path / "model.safetensors.index.json"
    good = json.loads(index.read_text())["weight_map"]
    outside = tmp_path.parent / f"{tmp_path.name}-outside.safetensors"
    st_numpy.save_file({"layer0.q": np.zeros(2, np.float32)}, outside)
    try:
        cases: list[tuple[str, type[Exception], str]] = [
            (str(outside), dmaload.SafetensorError, "outside the index's directory"),  # absolute
            (f"../{outside.name}", dmaload.SafetensorError, "outside the index's directory"),
            (f"sub/../../{outside.name}", dmaload.SafetensorError, "outside the index's directory"),
            ("", dmaload.SafetensorError, "not a file name"),
            (".", dmaload.SafetensorError, "not a file name"),
            ("a\0b.safetensors", dmaload.SafetensorError, "not a file name"),
            ("model-00009-of-00009.safetensors", FileNotFoundError, "does not exist"),
        ]
        for value, error, message in cases:
            index.write_text(json.dumps({"weight_map": dict(good, **{"layer0.q": value})}))
            with pytest.raises(error, match=message) as info:
                dst.load_file(index)
            assert "'layer0.q'" in str(info.value) and repr(value) in str(info.value), str(info.value)
            if error is FileNotFoundError:
                assert isinstance(info.value, OSError) and info.value.filename == str(tmp_path / value)
    finally:
        outside.unlink()
    # A tensor listed twice (json.loads would silently keep the last entry).
    first = next(iter(good))
    text = json.dumps({"weight_map": good})
    twice = text.replace("{", "{" + json.dumps(first) + ": " + json.dumps(good[first]) + ", ", 2)
    index.write_text(twice)
    with pytest.raises(dmaload.SafetensorError, match="twice"):
        dst.load_file(index)
    # Two spellings of one shard are one shard, loaded once.
    respelled = {k: (f"./{v}" if i % 2 else v) for i, (k, v) in enumerate(good.items())}
    index.write_text(json.dumps({"weight_map": respelled}))
    with dst.safe_open(index) as f:
        assert len(f.buffers) == 2 and set(f.keys()) == set(good)
    # A symlinked shard (as in the Hugging Face cache) is fine.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shard = good[first]
    (tmp_path / shard).rename(blobs / "blob1")
    (tmp_path / shard).symlink_to(Path("blobs") / "blob1")
    index.write_text(json.dumps({"weight_map": good}))
    assert set(dst.load_file(index)) == set(good)
