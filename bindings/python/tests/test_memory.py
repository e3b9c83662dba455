"""Host memory kinds from Python: what ``to="auto"`` chooses for each entry
point, and dropping a large buffer, then exiting, loses nothing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dmaload
from dmaload import _dmaload


def test_auto_keeps_an_fd_for_load_and_says_why(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with dmaload.load(path, to="auto") as buf:
        assert buf.memory in ("memfd", "memfd-huge", "hugetlb"), buf.report.memory_reason
        assert buf.report.memory_reason
        # The fd is the memfd holding the bytes.
        assert os.readlink(f"/proc/self/fd/{buf.fileno()}").startswith("/memfd:")
        assert os.pread(buf.fileno(), len(data), 0) == data
        assert bytes(memoryview(buf)) == data


def test_safetensors_loads_need_no_fd_so_auto_may_choose_anonymous_memory(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "m.safetensors"
    st.save_file({"w": np.arange(1 << 16, dtype=np.float32)}, path)
    [(buf, _header)] = _dmaload.load_safetensors([str(path)])
    report = buf.report
    assert report.memory == buf.memory and report.memory_reason
    if buf.memory in ("anonymous-thp", "anonymous"):
        # Chosen because no fd was needed: the reason says so.
        assert "no fd needed" in report.memory_reason or "--probe-memory" in report.memory_reason
        with pytest.raises(ValueError, match="no memfd"):
            buf.fileno()
    buf.close()
    from dmaload.safetensors.numpy import load_file

    assert load_file(path)["w"].tolist() == list(range(1 << 16))


@pytest.mark.parametrize("to", ["memfd", "anonymous-thp", "anonymous", "auto"])
def test_dropping_a_large_buffer_and_exiting_at_once_loses_nothing(tmp_path: Path, to: str) -> None:
    # Past the size whose unmapping goes to the background thread (64 MiB):
    # the interpreter exits while that thread may still be unmapping.
    path = tmp_path / "big.bin"
    data = bytes(range(256)) * ((96 << 20) // 256)
    path.write_bytes(data)
    script = (
        "import hashlib, sys, dmaload\n"
        f"buf = dmaload.load(sys.argv[1], to={to!r})\n"
        "digest = hashlib.sha256(memoryview(buf)).hexdigest()\n"
        "buf.close(); del buf\n"
        "print(digest, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == hashlib.sha256(data).hexdigest()


def test_a_forked_child_frees_what_it_drops(tmp_path: Path) -> None:
    # The unmapping thread does not survive fork: a child unmaps in place,
    # so its dropped buffers go at once and a load after them never waits.
    path = tmp_path / "big.bin"
    path.write_bytes(b"\x5a" * (96 << 20))
    parent_buf = dmaload.load(path, to="memfd")
    # Queued for the parent's unmapping thread; fork waits for it, so the
    # child inherits no mapping that nothing in it would ever unmap.
    del parent_buf
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child reports through its exit code)
        code = 1
        try:
            buf = dmaload.load(path, to="memfd")
            buf.close()
            del buf
            maps = Path("/proc/self/maps").read_text()
            again = dmaload.load(path, to="memfd")
            code = 0 if "memfd:dmaload" not in maps and memoryview(again)[0] == 0x5A else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
