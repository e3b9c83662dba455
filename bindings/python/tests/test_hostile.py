"""Hostile and careless use from Python: Ctrl-C and raising callbacks stop a
load before its end, slow callbacks do not slow it, special files are
refused without hanging, names that are not UTF-8 round-trip."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
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


def test_ctrl_c_stops_a_load_before_its_end(slow_file: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys, dmaload
        def progress(done, total):
            print("DONE", done, total, flush=True)
        try:
            dmaload.load(sys.argv[1], progress=progress, **{SLOW!r})
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            sys.exit(3)
        print("FINISHED", flush=True)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(slow_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    first = child.stdout.readline()  # handshake: the load is under way
    assert first.startswith("DONE"), first
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    lines = [first, *out.splitlines()]
    assert child.returncode == 3 and "INTERRUPTED" in out, f"{child.returncode}\n{out}\n{err}"
    last = max(int(line.split()[1]) for line in lines if line.startswith("DONE"))
    assert last < SLOW_SIZE, "the load ran to its end before Ctrl-C took effect"


class Stop(Exception):
    pass


def test_an_exception_in_the_callback_stops_the_load(slow_file: Path) -> None:
    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        raise Stop("enough")

    with pytest.raises(Stop):
        dmaload.load(slow_file, progress=progress, **SLOW)  # type: ignore[arg-type]
    assert len(seen) == 1 and seen[0] < SLOW_SIZE


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
