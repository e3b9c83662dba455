"""dmaload.load / load_range and the Buffer type."""

from __future__ import annotations

import errno
import fcntl
import json
import gc
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
from conftest import run_beside_a_python_thread, write_random

import dmaload
from dmaload import evict


def test_load_whole_file_bit_exact(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    buf = dmaload.load(path)
    assert len(buf) == len(data)
    assert bytes(memoryview(buf)) == data
    assert buf.path == str(path)
    assert not buf.closed


@pytest.mark.parametrize("engine", ["uring-fixed", "uring", "pread-pool", "read"])
@pytest.mark.parametrize("mode", ["auto", "buffered", "dontcache"])
def test_engines_and_modes(data_file: tuple[Path, bytes], engine: str, mode: str) -> None:
    path, data = data_file
    with dmaload.load(path, engine=engine, mode=mode, chunk_size="64K", gather_size="1M") as buf:  # type: ignore[arg-type]
        assert bytes(memoryview(buf)) == data
        assert buf.report.bytes == len(data)


def test_load_range_unaligned(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    for offset, length in [(0, 1), (1, 4095), (4097, 1 << 20), (len(data) - 5, 5), (len(data), 0)]:
        with dmaload.load_range(path, offset, length) as buf:
            assert bytes(memoryview(buf)) == data[offset : offset + length]
            assert buf.report.offset == offset
    with dmaload.load_range(path, 1000) as buf:
        assert bytes(memoryview(buf)) == data[1000:]


def test_load_from_a_descriptor_or_an_open_file(data_file: tuple[Path, bytes], tmp_path: Path) -> None:
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, 1000, os.SEEK_SET)
        seen: list[tuple[int, int]] = []
        with dmaload.load(fd, progress=lambda done, total: seen.append((done, total))) as buf:
            assert bytes(memoryview(buf)) == data
            assert buf.path == os.fspath(path)  # named by the file, not by the descriptor
        assert seen and seen[-1] == (len(data), len(data))
        with dmaload.load_range(fd, 5, 100) as buf:
            assert bytes(memoryview(buf)) == data[5:105]
        # The caller's descriptor is untouched: same offset, no O_DIRECT.
        assert os.lseek(fd, 0, os.SEEK_CUR) == 1000
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT == 0
    finally:
        os.close(fd)
    with open(path, "rb") as f, dmaload.load(f) as buf:
        assert bytes(memoryview(buf)) == data
    with pytest.raises(OSError) as e:
        dmaload.load(fd)  # closed now
    assert e.value.errno == errno.EBADF
    with pytest.raises(OSError) as e:
        dmaload.load(-1)
    assert e.value.errno == errno.EBADF
    with pytest.raises(TypeError):
        dmaload.load(True)  # type: ignore[arg-type]
    # A descriptor of a FIFO gets the same refusal as its path.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(OSError) as e:
            dmaload.load(rfd)
        assert e.value.errno == errno.EINVAL and "FIFO" in str(e.value).upper(), e.value
    finally:
        os.close(rfd)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_bytes(b"")
    with dmaload.load(path) as buf:
        assert len(buf) == 0
        assert bytes(memoryview(buf)) == b""
        assert np.frombuffer(buf, dtype=np.uint8).size == 0


def test_buffer_protocol_is_zero_copy_and_writable(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    buf = dmaload.load(path)
    a = np.frombuffer(buf, dtype=np.uint8)
    b = np.frombuffer(buf, dtype=np.uint8)
    assert a.flags.writeable
    assert np.shares_memory(a, b)
    a[0] ^= 0xFF
    assert b[0] == data[0] ^ 0xFF
    m = memoryview(buf)
    assert m.format == "B" and m.itemsize == 1 and m.ndim == 1 and m.nbytes == len(data) and not m.readonly
    assert m[0] == data[0] ^ 0xFF
    assert buf.exports == 3


def test_close_refuses_while_views_exist(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    buf = dmaload.load(path)
    arr = np.frombuffer(buf, dtype=np.uint8)
    with pytest.raises(BufferError):
        buf.close()
    assert not buf.closed and arr[:16].tobytes() == data[:16]
    del arr
    buf.close()
    assert buf.closed and len(buf) == 0
    buf.close()  # idempotent
    with pytest.raises(ValueError):
        memoryview(buf)
    with pytest.raises(ValueError):
        buf.fileno()


def test_context_manager_closes(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    with dmaload.load(path) as buf:
        assert not buf.closed
    assert buf.closed
    with pytest.raises(BufferError):
        with dmaload.load(path) as buf2:
            view = memoryview(buf2)
    view.release()
    buf2.close()


def test_views_keep_buffer_alive(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    buf = dmaload.load(path)
    ref = weakref.ref(buf)
    arr = np.frombuffer(buf, dtype=np.uint8)[10:20]
    del buf
    gc.collect()
    assert ref() is not None
    assert arr.tobytes() == data[10:20]
    del arr
    gc.collect()
    assert ref() is None


def test_memfd_export(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    buf = dmaload.load(path)
    fd = buf.fileno()
    assert os.fstat(fd).st_size >= len(data)
    off = buf.memfd_offset
    assert os.pread(fd, 100, off) == data[:100]
    dup = buf.dup_memfd()
    try:
        buf.close()
        # The duplicate keeps the memory after the buffer is closed.
        assert os.pread(dup, 100, off) == data[:100]
    finally:
        os.close(dup)
    assert buf.memory if not buf.closed else True


def test_anonymous_memory_has_no_memfd(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with dmaload.load(path, to="anonymous-thp") as buf:
        assert buf.memory == "anonymous-thp"
        assert bytes(memoryview(buf)[:64]) == data[:64]
        with pytest.raises(ValueError):
            buf.fileno()


def test_segments_cover_the_buffer(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with dmaload.load(path, gather_size="1M") as buf:
        segs = buf.segments
        assert segs[0][0] == 0 and sum(n for _, n in segs) == len(data)
        assert all(a + n == b for (a, n), (b, _) in zip(segs, segs[1:]))


def test_report_is_a_dataclass(data_file: tuple[Path, bytes]) -> None:
    import dataclasses

    path, data = data_file
    with dmaload.load(path) as buf:
        r = buf.report
        assert dataclasses.is_dataclass(r) and isinstance(r, dmaload.LoadReport)
        assert r.bytes == len(data) and r.path == str(path) and r.total_seconds > 0
        assert r.engine in ("uring-fixed", "uring", "pread-pool", "read")
        assert r.page_cache is None  # measured only when asked
        assert all(isinstance(f, dmaload.Fallback) for f in r.fallbacks)
        assert buf.report is r
        assert r.to_dict()["bytes"] == len(data)
        # Every field the native report has is a typed field here too.
        assert r.extra == {}, f"LoadReport lacks fields {sorted(r.extra)}"
        shmem = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        if shmem.exists():
            policy = shmem.read_text().split("[")[1].split("]")[0]
            assert r.huge_pages == (policy in ("always", "within_size", "advise", "force"))


def test_page_cache_residency_is_measured_only_when_asked(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    # Buffered reads leave the range cached, so a measurement has something to see.
    with dmaload.load(path, mode="buffered") as buf:
        assert buf.report.page_cache is None
        assert json.loads(buf.report_json)["page_cache"] is None
        assert dmaload.LoadReport.from_json(buf.report_json).page_cache is None
    with dmaload.load_range(path, 4096, 8192, mode="buffered", measure_page_cache=True) as buf:
        pc = buf.report.page_cache
        assert isinstance(pc, dmaload.PageCacheResidency)
        assert pc.resident_bytes == 8192 and pc.fraction > 0.99
        assert dmaload.LoadReport.from_json(buf.report_json).page_cache == pc
    with dmaload.load(path, measure_page_cache=False) as buf:
        assert buf.report.page_cache is None


def test_dlpack_numpy_and_torch(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    buf = dmaload.load(path)
    assert buf.__dlpack_device__() == (1, 0)
    arr = np.from_dlpack(buf)
    assert arr.dtype == np.uint8 and arr.tobytes() == data
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(buf)
    assert t.dtype == torch.uint8 and t.numel() == len(data) and bytes(t[:32].numpy()) == data[:32]
    del arr
    with pytest.raises(BufferError):
        buf.close()  # the torch tensor holds an export
    t[0] = 7
    assert memoryview(buf)[0] == 7
    del t
    gc.collect()
    buf.close()


def test_errors_are_oserror_with_errno_and_filename(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError) as e:
        dmaload.load(missing)
    assert e.value.errno == errno.ENOENT and e.value.filename == str(missing)
    with pytest.raises(IsADirectoryError) as e2:
        dmaload.load(tmp_path)
    assert e2.value.errno == errno.EISDIR
    small = tmp_path / "small"
    small.write_bytes(b"x" * 100)
    with pytest.raises(OSError) as e3:
        dmaload.load_range(small, 50, 100)
    assert e3.value.errno == errno.ENODATA and e3.value.filename == str(small)
    assert "offset" in str(e3.value)
    with pytest.raises(OSError) as e4:
        dmaload.load_range(small, 200, 1)
    assert "offset 200" in str(e4.value)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        dmaload.load("/dev/null", engine="warp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown destination"):
        dmaload.load("/dev/null", to="vram")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unknown load option.*memory"):
        dmaload.load("/dev/null", memory="memfd")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unknown load option"):
        dmaload.load("/dev/null", colour="red")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="invalid size"):
        dmaload.load("/dev/null", chunk_size="lots")
    with pytest.raises(OSError, match="chunk size"):
        dmaload.load(__file__, chunk_size=0)


def test_progress_callback(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    calls: list[tuple[int, int]] = []
    with dmaload.load(path, chunk_size="256K", progress=lambda d, t: calls.append((d, t))):
        pass
    assert calls and calls[-1] == (len(data), len(data))
    assert all(t == len(data) and 0 <= d <= t for d, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_progress_callback_exception_propagates(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file

    def boom(done: int, total: int) -> None:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        dmaload.load(path, progress=boom)


def test_progress_true_uses_tqdm(data_file: tuple[Path, bytes], capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    path, data = data_file
    with dmaload.load(path, progress=True) as buf:
        assert len(buf) == len(data)
    with pytest.raises(TypeError):
        dmaload.load(path, progress=3)  # type: ignore[arg-type]


def test_gil_is_released_during_load(tmp_path: Path) -> None:
    """A second Python thread keeps running while a load is in progress."""
    path = tmp_path / "big.bin"
    write_random(path, 256 << 20)
    evict(path)
    buf = run_beside_a_python_thread(
        lambda progress: dmaload.load(path, engine="read", mode="dontcache", chunk_size="1M", progress=progress),
        "load",
    )
    assert len(buf) == 256 << 20


def test_a_closed_buffer_refuses_clearly(data_file: tuple[Path, bytes]) -> None:
    """After close(): len 0, no new views, no fd; what describes the load
    (path, report) stays; close() and leaving a with block again are no-ops."""
    path, data = data_file
    buf = dmaload.load(path)
    buf.close()
    assert buf.closed and len(buf) == 0 and buf.exports == 0
    for call in (
        buf.fileno,
        buf.dup_memfd,
        lambda: memoryview(buf),
        lambda: bytes(buf),
        lambda: np.frombuffer(buf, dtype=np.uint8),
        buf.__dlpack__,
        lambda: buf.segments,
        lambda: buf.memory,
        lambda: buf.memfd_offset,
    ):
        with pytest.raises(ValueError, match="closed"):
            call()
    assert buf.path == str(path) and buf.report.bytes == len(data)
    assert "closed" in repr(buf) and buf.__dlpack_device__() == (1, 0)
    buf.close()
    with buf:
        pass


def test_pickling_and_copying_a_buffer_is_a_clear_type_error(data_file: tuple[Path, bytes]) -> None:
    import copy
    import pickle

    path, _ = data_file
    with dmaload.load(path) as buf:
        for call in (lambda: pickle.dumps(buf), lambda: copy.copy(buf), lambda: copy.deepcopy(buf)):
            with pytest.raises(TypeError, match="dup_memfd"):
                call()


def test_dlpack_arguments(data_file: tuple[Path, bytes]) -> None:
    """The DLPack keywords do what the standard says: copy=True gives a copy
    (no export of the buffer), a device other than the CPU is refused."""
    path, data = data_file
    with dmaload.load(path) as buf:
        copied = np.from_dlpack(buf, copy=True)
        assert copied.tobytes() == data and buf.exports == 0
        view = np.from_dlpack(buf, copy=False)
        assert buf.exports == 1
        view[0] ^= 0xFF
        assert memoryview(buf)[0] == data[0] ^ 0xFF and copied[0] == data[0]
        del view
        assert buf.__dlpack__(dl_device=(1, 0), max_version=(1, 0)) is not None
        with pytest.raises(BufferError):
            buf.__dlpack__(dl_device=(2, 0))  # kDLCUDA
        assert buf.exports == 0


def test_a_buffer_used_from_many_threads(data_file: tuple[Path, bytes]) -> None:
    """Threads making views, reading and closing at once: every outcome is
    a view with the right bytes or a clean BufferError/ValueError, never a
    crash, and the export count ends at zero."""
    path, data = data_file
    buf = dmaload.load(path)
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(200):
                try:
                    with memoryview(buf) as view:
                        assert view[: 64].tobytes() == data[:64]
                except ValueError:
                    assert buf.closed
                if i == 0:
                    try:
                        buf.close()
                    except BufferError:
                        pass
                len(buf), repr(buf), buf.report, buf.exports
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert buf.exports == 0
    buf.close()
    assert buf.closed
