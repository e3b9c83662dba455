"""``dmaload.save``: any C-contiguous buffer written to a file through the
core's save (atomic replace, O_DIRECT, io_uring), without copying it."""

from __future__ import annotations

import errno
import faulthandler
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import dmaload
from dmaload import _dmaload
from dmaload._options import SaveOptions

from conftest import write_random


def _leftovers(directory: Path, name: str) -> list[str]:
    """Temporary files a save could have left beside ``name``."""
    return sorted(p for p in os.listdir(directory) if p != name)


def test_save_options_are_the_cores() -> None:
    defaults = _dmaload._save_option_defaults()
    assert set(SaveOptions.__annotations__) == set(defaults)
    assert defaults == {
        "engine": "uring-fixed",
        "mode": "auto",
        "sync": True,
        "chunk_size": 4 << 20,
        "queue_depth": 32,
        "threads": 8,
    }
    doc = SaveOptions.__doc__ or ""
    for name in SaveOptions.__annotations__:
        assert name in doc, f"SaveOptions' docstring does not describe {name}"


def test_round_trip_of_bytes_and_bytearray(data_file: tuple[Path, bytes], tmp_path: Path) -> None:
    path, data = data_file
    for kind, value in (("bytes", data), ("bytearray", bytearray(data)), ("memoryview", memoryview(data))):
        out = tmp_path / f"{kind}.bin"
        report = dmaload.save(value, out)
        assert out.read_bytes() == data, kind
        assert isinstance(report, dmaload.SaveReport)
        assert (report.path, report.target, report.bytes) == (str(out), str(out), len(data))
        assert report.file_type == "regular file" and not report.in_place and not report.replaced
        assert report.engine in ("uring-fixed", "uring", "pread-pool", "read")
        assert report.cache in ("bypass", "keep")
        # The unaligned tail (123 bytes) never goes direct.
        assert report.direct_bytes <= len(data) - 123
        # Every phase was measured (a field left unset reads 0), within the whole.
        assert report.total_seconds >= report.write_seconds > 0
        assert all(isinstance(f, dmaload.Fallback) for f in report.fallbacks)
        # Every field the native report has is a typed field here too.
        assert report.extra == {}, f"SaveReport lacks fields {sorted(report.extra)}"


def test_a_save_report_names_a_path_that_is_not_utf8_exactly(tmp_path: Path) -> None:
    raw = os.fsencode(tmp_path) + b"/caf\xe9.bin"
    report = dmaload.save(b"x" * 5000, os.fsdecode(raw))
    assert os.fsencode(report.path) == raw and os.fsencode(report.target) == raw
    assert report.removed_tmpfiles == () and report.extra == {}


def test_round_trip_of_a_loaded_buffer(data_file: tuple[Path, bytes], tmp_path: Path) -> None:
    """load, then save the Buffer itself, then compare: the export is
    page-aligned memory, so the aligned part may go straight out O_DIRECT."""
    path, data = data_file
    out = tmp_path / "copy.bin"
    with dmaload.load(path) as buf:
        report = dmaload.save(buf, out, chunk_size="1M")
        assert buf.exports == 0, "the save's export outlived the call"
    assert out.read_bytes() == data
    assert report.bytes == len(data)
    if report.cache == "bypass":
        assert report.direct_bytes == len(data) // report.alignment * report.alignment
        assert report.direct_bytes + 123 >= len(data) > report.direct_bytes


def test_round_trip_of_numpy_arrays(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    for array in (
        rng.standard_normal((257, 33)).astype(np.float32),
        rng.integers(0, 1 << 16, 5001, dtype=np.uint16),
        np.zeros((0, 4), dtype=np.float64),
    ):
        out = tmp_path / f"{array.dtype}-{array.size}.bin"
        report = dmaload.save(array, out, engine="pread-pool", threads=3)
        assert out.read_bytes() == array.tobytes()
        assert report.bytes == array.nbytes
        back = np.fromfile(out, dtype=array.dtype).reshape(array.shape)
        assert np.array_equal(back, array)


@pytest.mark.parametrize("size", [1, 4095, 4097, (1 << 20) + 3])
def test_unaligned_lengths(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    out = tmp_path / "odd.bin"
    report = dmaload.save(data, out, mode="auto", chunk_size=4096, queue_depth=4)
    assert out.read_bytes() == data and report.bytes == size
    assert os.path.getsize(out) == size


def test_an_empty_buffer_saves_an_empty_file(tmp_path: Path) -> None:
    out = tmp_path / "empty.bin"
    out.write_bytes(b"old")
    report = dmaload.save(b"", out)
    assert out.read_bytes() == b"" and report.bytes == 0 and report.replaced


def test_replacing_a_file_leaves_no_temporary_file(tmp_path: Path) -> None:
    out = tmp_path / "model.bin"
    write_random(out, 100_000, seed=3)
    os.chmod(out, 0o640)
    new = os.urandom(200_001)
    for sync in (True, False):
        report = dmaload.save(new, out, sync=sync)
        assert out.read_bytes() == new and report.replaced
        assert report.removed_tmpfiles == ()
        assert _leftovers(tmp_path, "model.bin") == []
        # A replaced file keeps its permission bits.
        assert os.stat(out).st_mode & 0o777 == 0o640


def test_a_failed_save_keeps_the_old_file_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model.bin"
    old = write_random(out, 10_000, seed=4)
    with pytest.raises(OSError) as e:
        dmaload.save(b"new", out, mode="direct", queue_depth=0)
    assert e.value.errno == errno.EINVAL and "queue depth" in str(e.value)
    assert out.read_bytes() == old and _leftovers(tmp_path, "model.bin") == []


def test_a_missing_directory_is_file_not_found_naming_the_path(tmp_path: Path) -> None:
    out = tmp_path / "no" / "such" / "dir" / "model.bin"
    with pytest.raises(FileNotFoundError) as e:
        dmaload.save(b"bytes", out)
    assert e.value.errno == errno.ENOENT
    # The directory the temporary file would go to, which is missing.
    assert e.value.filename == str(out.parent)
    assert not (tmp_path / "no").exists()


def test_a_directory_target_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(OSError) as e:
        dmaload.save(b"bytes", tmp_path)
    assert e.value.filename is not None and str(tmp_path) in str(e.value.filename)


@pytest.mark.parametrize(
    ("options", "error", "names"),
    [
        ({"engine": "fast"}, ValueError, "engine"),
        ({"mode": "sideways"}, ValueError, "mode"),
        ({"chunk_size": "lots"}, ValueError, "invalid size"),
        ({"chunk_size": True}, TypeError, "size"),
        ({"queue_depth": True}, TypeError, "save option queue_depth"),
        ({"threads": "8"}, TypeError, "save option threads"),
        ({"queue_depth": -1}, TypeError, "save option queue_depth"),
        ({"sync": "yes"}, TypeError, "sync"),
        ({"gather_size": 1 << 20}, TypeError, "unknown save option.*gather_size"),
        ({"to": "memfd"}, TypeError, "unknown save option.*to"),
    ],
)
def test_bad_options_name_the_option(tmp_path: Path, options: dict[str, Any], error: type, names: str) -> None:
    out = tmp_path / "x.bin"
    with pytest.raises(error, match=names):
        dmaload.save(b"data", out, **options)
    assert not out.exists() and os.listdir(tmp_path) == []


def test_native_save_refuses_load_only_options(tmp_path: Path) -> None:
    """The native side checks the names again, as for a load."""
    with pytest.raises(TypeError, match='unknown save option "staging_slots"'):
        _dmaload.save(b"data", tmp_path / "x.bin", options={"staging_slots": 2})
    with pytest.raises(TypeError, match='unknown save option "nonsense"'):
        _dmaload.save(b"data", tmp_path / "x.bin", options={"nonsense": 2})


def test_counts_out_of_range_are_the_cores_einval(tmp_path: Path) -> None:
    for option, named in (("chunk_size", "chunk size"), ("queue_depth", "queue depth"), ("threads", "thread count")):
        with pytest.raises(OSError) as e:
            dmaload.save(b"data", tmp_path / "x.bin", **{option: 0})  # type: ignore[arg-type]
        assert e.value.errno == errno.EINVAL and named in str(e.value)
    assert os.listdir(tmp_path) == []


def test_progress_sees_the_final_total(tmp_path: Path) -> None:
    data = os.urandom((2 << 20) + 77)
    calls: list[tuple[int, int]] = []
    dmaload.save(data, tmp_path / "p.bin", chunk_size="64K", progress=lambda d, t: calls.append((d, t)))
    assert calls and calls[-1] == (len(data), len(data))
    assert all(t == len(data) and 0 <= d <= t for d, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    with pytest.raises(TypeError, match="progress"):
        dmaload.save(data, tmp_path / "p.bin", progress=3)  # type: ignore[arg-type]


def test_a_raising_progress_callback_is_raised_not_lost(tmp_path: Path) -> None:
    """As for a load, the callback's exception is what the call raises: it
    cancels the save, which ends as a failed one (no file, no temporary
    file) unless every byte was already in (then the file is complete)."""

    def boom(done: int, total: int) -> None:
        raise RuntimeError("stop the save")

    data = os.urandom(1 << 20)
    out = tmp_path / "p.bin"
    with pytest.raises(RuntimeError, match="stop the save"):
        dmaload.save(data, out, progress=boom)
    assert _leftovers(tmp_path, "p.bin") == []
    assert not out.exists() or out.read_bytes() == data


def test_progress_true_uses_tqdm(tmp_path: Path) -> None:
    pytest.importorskip("tqdm")
    data = os.urandom(100_000)
    dmaload.save(data, tmp_path / "t.bin", progress=True)
    assert (tmp_path / "t.bin").read_bytes() == data


def test_a_non_contiguous_array_is_refused(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    array = np.arange(64, dtype=np.float32).reshape(8, 8)
    out = tmp_path / "t.bin"
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        dmaload.save(array.T, out)
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        dmaload.save(array[:, ::2], out)
    assert not out.exists()
    # A Fortran-ordered array is contiguous, but not in C order: refused too.
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        dmaload.save(np.asfortranarray(array), out)
    # The same bytes, made contiguous, save.
    dmaload.save(np.ascontiguousarray(array.T), out)
    assert out.read_bytes() == array.T.tobytes()


def test_native_save_checks_contiguity_itself(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    strided = memoryview(np.arange(16, dtype=np.uint8))[::2]
    with pytest.raises(BufferError, match="C-contiguous"):
        _dmaload.save(strided, tmp_path / "t.bin")


def test_a_fifo_without_a_reader_errors_instead_of_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as e:
        dmaload.save(b"data", fifo)
    assert "no process is reading" in str(e.value)
    assert fifo.is_fifo() and _leftovers(tmp_path, "pipe") == []


def test_a_fifo_with_a_reader_is_written_in_place(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    data = os.urandom(300_000)  # more than a pipe holds: the writer waits for the reader
    received = bytearray()
    reader_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)

    def drain() -> None:
        # Non-blocking: before the save opens its end a read is EOF, after
        # it EAGAIN while the pipe is empty.
        deadline = time.monotonic() + 30
        while len(received) < len(data) and time.monotonic() < deadline:
            try:
                chunk = os.read(reader_fd, 1 << 16)
            except BlockingIOError:
                chunk = b""
            if chunk:
                received.extend(chunk)
            else:
                time.sleep(0.001)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        report = dmaload.save(data, fifo)
    finally:
        reader.join(timeout=30)
        os.close(reader_fd)
    assert bytes(received) == data
    assert report.in_place and report.file_type == "FIFO" and report.engine == "read"


def test_the_gil_is_released_during_a_save(tmp_path: Path) -> None:
    """A second Python thread runs while a save writes: the save goes into
    a FIFO whose only reader is a Python thread, so it can finish only if
    that thread runs meanwhile (a pipe holds far less than the data). Held,
    the GIL would hang both: faulthandler then ends the process instead."""
    data = os.urandom(8 << 20)
    fifo = tmp_path / "gil.fifo"
    os.mkfifo(fifo)
    received = bytearray()
    # A reader end held here, so the save finds a reader at once; the
    # thread's own end opens with the save's and reads until it closes.
    held = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)

    def read_all() -> None:
        with open(fifo, "rb") as reader:
            while chunk := reader.read(1 << 16):
                received.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    faulthandler.dump_traceback_later(600, exit=True)
    try:
        dmaload.save(data, fifo)
    finally:
        # A writer that leaves at once lets the thread's open() return even
        # if the save's end came and went before it (or never came).
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join()
        faulthandler.cancel_dump_traceback_later()
        os.close(held)
    assert bytes(received) == data


def test_a_closed_buffer_cannot_be_saved(data_file: tuple[Path, bytes], tmp_path: Path) -> None:
    path, _ = data_file
    buf = dmaload.load(path)
    buf.close()
    with pytest.raises(ValueError, match="closed"):
        dmaload.save(buf, tmp_path / "c.bin")
    assert os.listdir(tmp_path) == ["data.bin"]


def test_a_bytearray_cannot_resize_while_it_is_saved(tmp_path: Path) -> None:
    """The export is held for the whole call: after it, the bytearray is free again."""
    data = bytearray(os.urandom(1 << 16))
    dmaload.save(data, tmp_path / "b.bin")
    data.extend(b"more")  # no export left behind
    assert (tmp_path / "b.bin").read_bytes() == bytes(data[:-4])


def test_a_fifo_whose_reader_leaves_is_broken_pipe(tmp_path: Path) -> None:
    """EPIPE at the offset reached, never a SIGPIPE that kills Python."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    got_some = threading.Event()

    def read_a_little_then_leave() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if os.read(reader_fd, 4096):
                    break
            except BlockingIOError:
                pass
            time.sleep(0.001)
        got_some.set()
        os.close(reader_fd)

    reader = threading.Thread(target=read_a_little_then_leave)
    reader.start()
    try:
        with pytest.raises(BrokenPipeError) as e:
            dmaload.save(os.urandom(4 << 20), fifo)
    finally:
        reader.join(timeout=30)
    assert got_some.is_set() and "offset" in str(e.value)


def test_round_trip_of_torch_tensors(tmp_path: Path) -> None:
    """A CPU tensor saves through ``numpy()``, a bfloat16 one (which numpy
    lacks) through a uint8 view of its bytes; neither is copied."""
    torch = pytest.importorskip("torch")
    t = torch.arange(10_000, dtype=torch.float32).reshape(100, 100)
    out = tmp_path / "t.bin"
    dmaload.save(t.numpy(), out)
    back = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.float32).reshape(100, 100)
    assert torch.equal(back, t)
    b = torch.randn(33, 17).to(torch.bfloat16)
    dmaload.save(b.view(torch.uint8).numpy(), out)
    back_b = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.bfloat16).reshape(33, 17)
    assert torch.equal(back_b, b)
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        dmaload.save(t.T.numpy(), out)
