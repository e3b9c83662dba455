"""dmaload.load_into: memory the caller owns (bytearray, numpy, torch),
filled in place where it lines up with the file, through a ring where not."""

from __future__ import annotations

import errno
import mmap
from pathlib import Path

import numpy as np
import pytest

import dmaload
from dmaload import evict


def test_bytearray_and_numpy_get_the_exact_bytes(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    evict(path)
    target = bytearray(len(data) - 5)
    report = dmaload.load_into(path, target, 5)
    assert bytes(target) == data[5:]
    assert (report.offset, report.bytes) == (5, len(data) - 5)
    assert report.destination.startswith("caller memory")

    array = np.zeros(1000, dtype=np.uint32)
    dmaload.load_into(path, array, 4096)
    assert array.tobytes() == data[4096 : 4096 + 4000]


def test_an_empty_array_of_any_shape_takes_an_empty_range(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    for shape in ((0,), (0, 4), (3, 0, 2)):
        report = dmaload.load_into(path, np.zeros(shape, dtype=np.float32), 100)
        assert (report.offset, report.bytes) == (100, 0), shape


def test_page_aligned_memory_is_filled_in_place(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    evict(path)
    with mmap.mmap(-1, 2 << 20) as memory:  # page-aligned anonymous memory
        report = dmaload.load_into(path, memory, 1 << 20)
        assert memory[:] == data[1 << 20 : 3 << 20]
        assert report.destination == "caller memory (in place)"


def test_torch_tensor_memory(data_file: tuple[Path, bytes]) -> None:
    torch = pytest.importorskip("torch")
    path, data = data_file
    tensor = torch.zeros(len(data) // 2, dtype=torch.int16)
    dmaload.load_into(path, tensor.numpy(), progress=lambda done, total: None)
    assert tensor.numpy().tobytes() == data[: len(data) // 2 * 2]


def test_refusals(data_file: tuple[Path, bytes], tmp_path: Path) -> None:
    path, data = data_file
    with pytest.raises(OSError) as excinfo:
        dmaload.load_into(path, bytearray(len(data) + 1))
    assert excinfo.value.errno == errno.ENODATA
    with pytest.raises(FileNotFoundError):
        dmaload.load_into(tmp_path / "absent", bytearray(1))
    with pytest.raises((TypeError, ValueError)):
        dmaload.load_into(path, b"read-only bytes")
    with pytest.raises((TypeError, ValueError)):
        dmaload.load_into(path, np.zeros((4, 4), dtype=np.uint8)[:, ::2])  # not contiguous
    with pytest.raises(TypeError):
        dmaload.load_into(path, bytearray(1), to="memfd")
    with pytest.raises(ValueError):
        dmaload.load_into(path, bytearray(1), -1)


def test_a_failing_progress_callback_stops_the_load(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file

    def explode(done: int, total: int) -> None:
        raise KeyError("stop")

    with pytest.raises(KeyError):
        dmaload.load_into(path, bytearray(len(data)), progress=explode)


def test_arrivals_say_how_much_is_in_while_the_load_runs(data_file: tuple[Path, bytes]) -> None:
    """``arrived`` grows gather by gather (1 MiB gathers of 256 KiB reads) over bytes
    that are already the file's when it is called, and ends at the whole
    length; raising from it cancels the load and is raised."""
    path, data = data_file
    evict(path)
    with mmap.mmap(-1, len(data)) as memory:  # page-aligned: read in place from byte 0
        seen: list[int] = []

        def arrived(n: int) -> None:
            assert memory[:n] == data[:n], n
            seen.append(n)

        dmaload.load_into(path, memory, arrived=arrived, gather_size="1M", chunk_size="256K")
        assert len(seen) > 2 and seen == sorted(set(seen)) and seen[-1] == len(data), seen
        assert memory[:] == data

    def explode(n: int) -> None:
        raise KeyError("stop")

    with pytest.raises(KeyError):
        dmaload.load_into(path, bytearray(len(data)), arrived=explode)


def test_evict_drops_a_file_and_names_a_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    evict(path)  # the core's pagecache::evict: fdatasync, then DONTNEED
    assert path.read_bytes() == bytes(range(256)) * 64
    with pytest.raises(FileNotFoundError) as err:
        evict(tmp_path / "missing")
    assert "missing" in str(err.value)
