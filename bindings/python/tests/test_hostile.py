"""Hostile and careless use from Python: Ctrl-C and raising callbacks stop a
load before its end, slow callbacks do not slow it, special files are
refused without hanging, names that are not UTF-8 round-trip."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import dmaload
from conftest import write_random

# Many small direct reads one at a time: a load that takes seconds, so a
# cancellation that waited for the end would show as done == total.
SLOW = {"engine": "read", "mode": "direct", "chunk_size": 4096, "queue_depth": 1}
SLOW_SIZE = 128 << 20


@pytest.fixture(scope="module")
def slow_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # On the root filesystem, where O_DIRECT works (not tmpfs).
    base = Path(os.environ.get("DMALOAD_TEST_DIR", "/var/tmp"))
    d = Path(tmp_path_factory.mktemp("hostile", numbered=True))
    path = base / f"dmaload-hostile-{os.getpid()}-{d.name}.bin"
    with open(path, "wb") as f:
        for _ in range(SLOW_SIZE >> 20):
            f.write(os.urandom(1 << 20))
    yield path
    path.unlink()


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded safetensors model (index + 2 shards of SLOW_SIZE / 2) on disk."""
    np = pytest.importorskip("numpy")
    st_numpy = pytest.importorskip("safetensors.numpy")
    base = Path(os.environ.get("DMALOAD_TEST_DIR", "/var/tmp"))
    d = base / f"dmaload-hostile-model-{os.getpid()}-{tmp_path_factory.mktemp('m').name}"
    d.mkdir()
    weight_map = {}
    for i in range(2):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        rng = np.random.default_rng(i)
        st_numpy.save_file({f"w{i}": rng.integers(0, 255, SLOW_SIZE // 2, dtype=np.uint8)}, d / name)
        weight_map[f"w{i}"] = name
    (d / "model.safetensors.index.json").write_text(__import__("json").dumps({"weight_map": weight_map}))
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


# How each loading entry point is called on the slow file (or model).
ENTRIES = {
    "load": "dmaload.load(path, progress=progress, **SLOW)",
    "load_range": "dmaload.load_range(path, 4097, SIZE - 8192, progress=progress, **SLOW)",
    "safetensors sharded": "load_file(model, progress=progress, concurrency=2, **SLOW)",
}


def _rchar() -> int:
    """Bytes this process has read with read()-like calls (/proc/self/io):
    the "read" engine's reads count here, so a load that stopped early has
    read less than the file."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_ctrl_c_stops_a_load_before_its_end(entry: str, slow_file: Path, slow_model: Path) -> None:
    """A real SIGINT, sent once the child's progress callback shows the load
    under way, raises KeyboardInterrupt from the load before it has read
    the whole file (handshake and byte counts, no timing)."""
    code = textwrap.dedent(
        f"""
        import signal, sys, dmaload
        from dmaload.safetensors import load_file
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
        path, model, SIZE, SLOW = sys.argv[1], sys.argv[2], {SLOW_SIZE}, {SLOW!r}
        def progress(done, total):
            print("DONE", done, total, flush=True)
        try:
            {ENTRIES[entry]}
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            sys.exit(3)
        print("FINISHED", flush=True)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(slow_file), str(slow_model)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    first = child.stdout.readline()  # handshake: the load is under way
    assert first.startswith("DONE"), first + (child.stderr.read() if child.stderr else "")
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    lines = [first, *out.splitlines()]
    assert child.returncode == 3 and "INTERRUPTED" in out, f"{child.returncode}\n{out}\n{err}"
    reports = [line.split() for line in lines if line.startswith("DONE")]
    total = int(reports[0][2])
    assert max(int(r[1]) for r in reports) < total, "the load ran to its end before Ctrl-C took effect"


class Stop(Exception):
    pass


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_an_exception_in_the_callback_stops_the_load(entry: str, slow_file: Path, slow_model: Path) -> None:
    """The callback's own exception comes out of the load, and the load
    stopped: the process read far less than the file (/proc/self/io)."""
    from dmaload.safetensors import load_file

    seen: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        raise Stop("enough")

    path, model, SIZE = slow_file, slow_model, SLOW_SIZE  # noqa: F841 - used by ENTRIES
    before = _rchar()
    with pytest.raises(Stop, match="enough"):
        eval(ENTRIES[entry])
    read = _rchar() - before
    assert seen and all(done < total for done, total in seen)
    assert read < seen[0][1] // 2, f"read {read} of {seen[0][1]} bytes: the load went on after the exception"


def test_a_slow_callback_does_not_serialize_the_reads(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    data = write_random(path, 32 << 20)
    chunk = 256 << 10
    calls = 0

    def progress(done: int, total: int) -> None:
        nonlocal calls
        calls += 1
        threading.Event().wait(0.2)

    with dmaload.load(path, progress=progress, chunk_size=chunk) as buf:
        assert bytes(memoryview(buf)) == data
    # One call per read would be 128 calls; a reporting thread makes a few.
    assert 1 <= calls < (32 << 20) // chunk // 2


def test_a_fifo_is_an_error_not_a_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = textwrap.dedent(
        """
        import sys, dmaload
        from dmaload.safetensors.numpy import load_file
        for load in (dmaload.load, load_file):
            try:
                load(sys.argv[1])
            except OSError as e:
                assert "FIFO" in str(e), e
            else:
                raise SystemExit("loaded a FIFO")
        print("REFUSED")
        """
    )
    out = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "REFUSED" in out.stdout, f"{out.stdout}\n{out.stderr}"

def test_evict_refuses_a_fifo_as_having_no_page_cache(tmp_path: Path) -> None:
    """A FIFO has no page cache: evict says so, naming it, without opening
    it (a FIFO without a writer would hang the open)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = textwrap.dedent(
        """
        import errno, sys, dmaload
        try:
            dmaload.evict(sys.argv[1])
        except OSError as e:
            assert e.errno == errno.EINVAL and e.filename == sys.argv[1], e
            assert "a FIFO has no page cache to evict" in str(e), e
        else:
            raise SystemExit("evicted a FIFO")
        print("REFUSED")
        """
    )
    out = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "REFUSED" in out.stdout, f"{out.stdout}\n{out.stderr}"


def test_an_index_that_is_not_a_regular_file_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """A sharded model's index that is a FIFO (no writer: reading it would
    block for ever) or a device that never ends (/dev/zero: reading it
    would exhaust memory) is refused by type, naming the index."""
    os.mkfifo(tmp_path / "fifo.safetensors.index.json")
    (tmp_path / "zero.safetensors.index.json").symlink_to("/dev/zero")
    code = textwrap.dedent(
        """
        import errno, sys
        from dmaload.safetensors import load_file
        for index in sys.argv[1:]:
            try:
                load_file(index)
            except OSError as e:
                assert e.errno == errno.EINVAL and e.filename == index and "regular file" in str(e), e
            else:
                raise SystemExit("loaded " + index)
        print("REFUSED")
        """
    )
    indexes = [str(tmp_path / f"{kind}.safetensors.index.json") for kind in ("fifo", "zero")]
    out = subprocess.run([sys.executable, "-c", code, *indexes], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "REFUSED" in out.stdout, f"{out.stdout}\n{out.stderr}"



def test_a_name_that_is_not_utf8_round_trips(tmp_path: Path) -> None:
    raw = os.fsencode(tmp_path) + b"/model-\xff\xfe.bin"
    data = os.urandom(12345)
    with open(raw, "wb") as f:
        f.write(data)
    name = os.fsdecode(raw)
    with dmaload.load(name) as buf:
        assert bytes(memoryview(buf)) == data
        assert buf.report.path == name
        assert os.fsencode(buf.report.path) == raw
        assert buf.report.bytes == 12345


def test_a_panic_is_a_runtime_error_not_a_panic_exception() -> None:
    """The guard every entry point goes through: a panic with the GIL held,
    with it released, and on the load thread each reach Python as a
    RuntimeError, which ``except Exception`` catches (PyO3's own
    PanicException derives from BaseException and would not be)."""
    from dmaload import _dmaload

    for place in ("gil", "detached", "load"):
        try:
            _dmaload._test_panic(place)
        except Exception as exc:  # noqa: BLE001 - the point of the test
            assert type(exc) is RuntimeError, (place, type(exc).__mro__)
            assert "internal error in dmaload" in str(exc) and place in str(exc)
        else:
            raise AssertionError(f"no exception from a panic ({place})")


def _unprivileged_nproc_1() -> list[str]:
    """argv prefix running a command as nobody with RLIMIT_NPROC = 1 (so it
    can create no thread), keeping read access to this root-owned venv."""
    import shutil

    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user (root ignores RLIMIT_NPROC)")
    if not (shutil.which("setpriv") and shutil.which("prlimit")):
        pytest.skip("needs setpriv and prlimit (util-linux)")
    caps = "+dac_read_search"
    return [
        "prlimit", "--nproc=1",
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        f"--inh-caps={caps}", f"--ambient-caps={caps}",
    ]  # fmt: skip


def _run_without_threads(prefix: list[str], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs Python ``code`` with ``args`` under ``prefix`` (see
    ``_unprivileged_nproc_1``), checking that the limit did bite: the code
    prints NO-THREADS when a ``threading.Thread`` cannot start."""
    out = subprocess.run(
        [*prefix, sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
        # OpenBLAS (imported with numpy) kills the process when it cannot start its threads.
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    assert "NO-THREADS" in out.stdout, f"the limit did not bite:\n{out.stdout}\n{out.stderr}"
    return out


def test_no_thread_can_be_created_is_never_a_panic(tmp_path: Path) -> None:
    """Issue 7: with RLIMIT_NPROC exhausted, thread creation failed with a
    panic (PanicException in Python). Every loading entry point, with and
    without a progress callback, must either load the bytes (falling back
    to running on fewer threads) or raise an ordinary Exception."""
    prefix = _unprivileged_nproc_1()
    os.chmod(tmp_path, 0o755)
    data = tmp_path / "data.bin"
    write_random(data, (3 << 20) + 5)
    np = pytest.importorskip("numpy")
    st_numpy = pytest.importorskip("safetensors.numpy")
    for i in range(3):
        st_numpy.save_file({f"t{i}": np.arange(1000 + i, dtype=np.float32)}, tmp_path / f"s{i}.safetensors")
    for p in tmp_path.iterdir():
        os.chmod(p, 0o644)
    code = textwrap.dedent(
        """
        import sys, threading
        import dmaload
        from dmaload.safetensors import load_file
        path, model, expected = sys.argv[1], sys.argv[2], open(sys.argv[1], "rb").read()
        try:
            threading.Thread(target=print).start()
        except RuntimeError:
            print("NO-THREADS")
        for engine in ("uring-fixed", "uring", "pread-pool", "read"):
            for progress in (None, lambda d, t: None):
                for call in (
                    lambda: bytes(memoryview(dmaload.load(path, engine=engine, progress=progress))) == expected,
                    lambda: bytes(memoryview(dmaload.load_range(path, 7, 1 << 20, engine=engine,
                                                                progress=progress))) == expected[7:7 + (1 << 20)],
                    lambda: sorted(load_file(model, engine=engine, progress=progress)) == ["t0", "t1", "t2"],
                ):
                    try:
                        assert call(), "wrong bytes"
                    except Exception as exc:
                        print("ERROR", engine, type(exc).__name__, exc)
        print("SURVIVED")
        """
    )
    out = _run_without_threads(prefix, code, str(data), str(tmp_path))
    assert out.returncode == 0 and "SURVIVED" in out.stdout, f"{out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "PanicException" not in out.stdout + out.stderr and "panicked" not in out.stderr, out.stderr


def test_a_load_larger_than_its_staging_ring_without_a_thread_runs_on_the_calling_thread(tmp_path: Path) -> None:
    """Issue 34: with no thread creatable, a staged load larger than its
    ring failed EAGAIN "create the delivery thread": ``load_into`` of more
    than 32 MiB into unaligned memory, and ``dmaload.load()`` of 64 MiB or
    more where reads go through the staging ring (a device whose requests
    take few page entries, as a virtio disk's). Each reads a ring's worth,
    then delivers it, in turn on the calling thread."""
    prefix = _unprivileged_nproc_1()
    os.chmod(tmp_path, 0o755)
    data = tmp_path / "data.bin"
    write_random(data, (65 << 20) + 5)
    os.chmod(data, 0o644)
    dmaload.evict(data)
    code = textwrap.dedent(
        """
        import sys, threading
        import dmaload
        path = sys.argv[1]
        expected = open(path, "rb").read()
        dmaload.evict(path)
        try:
            threading.Thread(target=print).start()
        except RuntimeError:
            print("NO-THREADS")
        buf = dmaload.load(path)
        print("LOAD", bytes(memoryview(buf)) == expected, buf.report.destination)
        target = bytearray(len(expected) + 1)
        report = dmaload.load_into(path, memoryview(target)[1:])
        print("INTO", target[1:] == expected, report.destination)
        print("FALLBACKS", [str(f) for f in report.fallbacks])
        """
    )
    out = _run_without_threads(prefix, code, str(data))
    assert out.returncode == 0, f"{out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "LOAD True" in out.stdout and "INTO True caller memory (staged" in out.stdout, out.stdout + out.stderr
    assert "in turn on the calling thread" in out.stdout, out.stdout


def test_a_stream_whose_loader_can_start_no_thread_loads_each_window_at_once(tmp_path: Path) -> None:
    """A one-rank stream's native ``WindowLoader`` with RLIMIT_NPROC
    exhausted: none of its threads starts, so ``submit`` loads the window
    at once (the GIL released) instead of queuing it; the loads' own
    helper threads fall back as well. Every byte arrives, through the
    loader alone and through ``iter_tensors`` on it."""
    prefix = _unprivileged_nproc_1()
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    os.chmod(tmp_path, 0o755)
    model = tmp_path / "m.safetensors"
    gen = torch.Generator().manual_seed(0)
    st_torch.save_file({f"t{i}": torch.randn(300_000 + 1000 * i, generator=gen) for i in range(8)}, model)
    os.chmod(model, 0o644)
    code = textwrap.dedent(
        """
        import sys, threading
        from dmaload import _dmaload
        from dmaload.safetensors import iter_tensors
        from safetensors.torch import load_file
        path = sys.argv[1]
        try:
            threading.Thread(target=print).start()
        except RuntimeError:
            print("NO-THREADS")
        loader = _dmaload.WindowLoader([path], in_flight=2)
        target = bytearray(5 << 20)
        arrival = loader.submit(0, 4096, target)
        print("LOADER", arrival.count() == len(target), target == open(path, "rb").read()[4096:4096 + (5 << 20)])
        arrival.wait_done()
        loader.close()
        want = load_file(path)
        got = {n: t.clone() for n, t in iter_tensors([path], "cpu", recycle=True, window="1M")}
        print("STREAM", sorted(got) == sorted(want) and all(bool((got[k] == want[k]).all()) for k in want))
        """
    )
    out = _run_without_threads(prefix, code, str(model))
    assert out.returncode == 0, f"{out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "LOADER True True" in out.stdout and "STREAM True" in out.stdout, f"{out.stdout}\n{out.stderr}"


def test_the_report_of_a_name_that_is_not_utf8_is_complete(tmp_path: Path) -> None:
    """The report crosses as a typed record built field by field: every
    field is there for a name that is not UTF-8 (the JSON route gave an
    empty report), and the path is the exact os.fsdecode form."""
    raw = os.fsencode(tmp_path) + b"/\xff\xfe.bin"
    data = os.urandom(4096 * 3 + 17)
    with open(raw, "wb") as f:
        f.write(data)
    with dmaload.load(os.fsdecode(raw), engine="pread-pool") as buf:
        report = buf.report
    assert isinstance(report, dmaload.LoadReport)
    assert os.fsencode(report.path) == raw and buf.path == os.fsdecode(raw)
    assert report.bytes == len(data) and report.offset == 0
    assert report.engine == "pread-pool" and report.memory == "memfd"
    assert report.cache in ("bypass", "keep", "dont-cache", "fadvise")
    assert report.chunk_size > 0 and report.gather_size > 0 and report.total_seconds > 0
    assert report.page_cache is None  # not asked for
    assert report.extra == {}
    with dmaload.load_range(os.fsdecode(raw), 4096, 100) as part:
        assert part.report.offset == 4096 and part.report.bytes == 100
        assert os.fsencode(part.report.path) == raw


FAULTY_FUSE = Path(__file__).resolve().parents[3] / "crates/dmaload/tests/support/faulty_fuse.py"


# Each call that reads the FUSE file `p` (64 MiB: a safetensors header,
# then zeros), and the offset of the read the server never answers: into
# memory the load allocates, into the caller's, through the cache-service
# path with no service, the safetensors loader, and the header reads that
# multi-shard and device loads begin with (native entry points).
SILENT_SERVER_CALLS = {
    "load": ("dmaload.load(p)", 40 << 20),
    "load_into": ("dmaload.load_into(p, bytearray(64 << 20))", 40 << 20),
    "load with cache": ("dmaload.load(p, cache='/nonexistent/dmaload.sock')", 40 << 20),
    "safetensors load_file": ("dmaload.safetensors.numpy.load_file(p)", 40 << 20),
    "read_safetensors_header": ("dmaload._dmaload.read_safetensors_header(p)", 0),
    "open_safetensors": ("dmaload._dmaload.open_safetensors(p)", 0),
}


def _safetensors_header(size: int) -> bytes:
    """A safetensors header whose one U8 tensor fills a file of ``size``."""
    json_len = 128
    data = size - 8 - json_len
    text = '{"w":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]}}' % (data, data)
    return json_len.to_bytes(8, "little") + text.ljust(json_len).encode()


@pytest.mark.parametrize("call", sorted(SILENT_SERVER_CALLS))
def test_ctrl_c_returns_while_a_silent_fuse_server_holds_a_read(tmp_path: Path, call: str) -> None:
    """A FUSE server that never answers one read (no cancellation reaches
    it): Ctrl-C still raises KeyboardInterrupt in the loading process at
    once (not a BufferError over the caller's still-exported memory); the
    read is left to the load's own thread, which frees the buffer, or
    releases the caller's, when it ends (here: when the process exits).
    Before, the load waited for the read for good."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        pytest.skip("mounting FUSE needs root and /dev/fuse")
    if subprocess.run([sys.executable, "-c", "import fuse"], capture_output=True).returncode != 0:
        pytest.skip("fusepy (pip) and libfuse2 are not installed")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    expression, bad = SILENT_SERVER_CALLS[call]
    size = 64 << 20
    prefix = tmp_path / "header"
    prefix.write_bytes(_safetensors_header(size))
    server = subprocess.Popen(
        [sys.executable, str(FAULTY_FUSE), str(mnt), str(size), str(bad), "4096", "hang", str(prefix)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    child = None
    try:
        deadline = time.monotonic() + 20
        while not (mnt / "data").exists():
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "the FUSE mount did not appear"
            time.sleep(0.05)
        code = textwrap.dedent(
            """
            import signal, sys, time, dmaload, dmaload.safetensors.numpy
            signal.signal(signal.SIGINT, signal.default_int_handler)
            p = sys.argv[1]
            try:
                eval(sys.argv[2])
            except KeyboardInterrupt:
                print("INTERRUPTED", time.monotonic(), flush=True)
                sys.exit(3)
            print("FINISHED", flush=True)
            """
        )
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(mnt / "data"), expression],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = server.stdout.readline()  # the server holds the read now
        assert line == "HANGING\n", line
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        # Read the line, not to the end: the process cannot finish exiting
        # while the kernel holds its read (a thread in the FUSE request).
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 30)
        assert ready, "no KeyboardInterrupt within 30 s: the load waited for the held read"
        said = child.stdout.readline()
        assert said.startswith("INTERRUPTED"), said + (child.stderr.read() if child.stderr else "")
        print(f"KeyboardInterrupt {1000 * (float(said.split()[1]) - sent):.1f} ms after SIGINT, a read still held")
    finally:
        # The server first: its end fails the held read, so the child can exit.
        server.kill()
        server.wait()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        if child is not None:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    assert child.returncode == 3, child.returncode
