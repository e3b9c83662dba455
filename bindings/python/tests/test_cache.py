"""Sharing loaded files between processes: ``Buffer.send``/``receive`` and
``cache=`` through the model-cache service (the native ``dmaload serve``),
with real processes on real sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dmaload
import dmaload.safetensors as dst
from dmaload.__main__ import native_cli

REPO = Path(__file__).resolve().parents[3]


def _cli() -> str | None:
    built = REPO / "target" / "release" / "dmaload"
    return str(built) if built.is_file() else native_cli()


class Service:
    """``dmaload serve`` on a socket of its own, killed at the end."""

    def __init__(self, socket_path: Path, *args: str) -> None:
        cli = _cli()
        if cli is None:
            pytest.skip("SKIP cache service: the native dmaload CLI is not built (cargo build --release)")
        self.socket = socket_path
        self.proc = subprocess.Popen(
            [cli, "serve", "--socket", str(socket_path), *args], stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 60
        while not self._answers():
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.01)

    def _answers(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(str(self.socket))
            return True
        except OSError:
            return False

    def status(self) -> dict[str, object]:
        cli = _cli()
        assert cli is not None
        out = subprocess.run(
            [cli, "serve", "--status", "--json", "--socket", str(self.socket)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        result: dict[str, object] = json.loads(out.stdout)
        return result

    def memfds(self) -> int:
        def target(fd: Path) -> str:
            try:
                return os.readlink(fd)
            except FileNotFoundError:  # closed since the listing (a client's, going)
                return ""

        fds = Path(f"/proc/{self.proc.pid}/fd")
        return sum(1 for fd in fds.iterdir() if target(fd).startswith("/memfd:"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    s = Service(tmp_path / "cache.sock")
    try:
        yield s
    finally:
        s.stop()


def _fresh(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Runs ``code`` in a fresh Python process; its stdout."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_buffer_crosses_to_another_process_bit_exact_and_private(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    buf = dmaload.load(path)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = (
        "import hashlib, os, socket, sys, dmaload\n"
        "s = socket.socket(fileno=int(sys.argv[1]))\n"
        "b = dmaload.Buffer.receive(s)\n"
        "print(hashlib.sha256(memoryview(b)).hexdigest(), b.report.destination)\n"
        "memoryview(b)[:4096] = bytes(4096)\n"  # private: the sender must not see it
        "s.send(b'written')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(child.fileno())], pass_fds=[child.fileno()], stdout=subprocess.PIPE, text=True
    )
    child.close()
    buf.send(parent)
    assert parent.recv(16) == b"written"
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    import hashlib

    assert out.split() == [hashlib.sha256(data).hexdigest(), "received"]
    assert bytes(buf) == data
    with pytest.raises(OSError, match="not a Unix SOCK_SEQPACKET socket"):
        buf.send(socket.socketpair()[0])
    # The sender's writes are private too once the memfd is shared, and a
    # buffer so written is not sent again with bytes it no longer shows.
    memoryview(buf)[0] ^= 0xFF
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with pytest.raises(OSError, match="no longer holds the bytes"):
        buf.send(a.fileno())


def test_forged_handoffs_are_refused(tmp_path: Path) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    message = json.dumps({"version": 2, "body": {"reply": "buffer", "offset": 0, "len": 10}}).encode()
    with open(tmp_path / "f", "wb+") as f:
        f.write(bytes(8192))
        f.flush()
        socket.send_fds(a, [message], [f.fileno()])
    with pytest.raises(OSError, match="not a sealable memfd"):
        dmaload.Buffer.receive(b)
    unsealed = os.memfd_create("forged", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 8192)
    socket.send_fds(a, [message], [unsealed])
    with pytest.raises(OSError, match="not sealed"):
        dmaload.Buffer.receive(b)


def test_cache_serves_fresh_processes_the_same_bytes(service: Service, data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    code = (
        "import hashlib, sys, dmaload\n"
        "b = dmaload.load(sys.argv[1], cache=sys.argv[2])\n"
        "print(hashlib.sha256(memoryview(b)).hexdigest(), b.report.destination)\n"
    )
    import hashlib

    digest = hashlib.sha256(data).hexdigest()
    assert _fresh(code, str(path), str(service.socket)) == f"{digest} cache-service (miss)"
    assert _fresh(code, str(path), str(service.socket)) == f"{digest} cache-service (hit)"
    # DMALOAD_CACHE names the socket for code that does not pass cache=.
    env = dict(os.environ, DMALOAD_CACHE=str(service.socket))
    plain = "import hashlib, sys, dmaload\nb = dmaload.load(sys.argv[1])\nprint(b.report.destination)\n"
    assert _fresh(plain, str(path), env=env) == "cache-service (hit)"
    status = service.status()
    assert (status["misses"], status["hits"], status["files_cached"]) == (1, 2, 1)

    # A file that fails to load: the same error as a direct load, no fallback.
    with pytest.raises(OSError) as direct:
        dmaload.load("/proc/self/status")
    with pytest.raises(OSError) as served:
        dmaload.load("/proc/self/status", cache=service.socket)
    assert (served.value.errno, str(served.value)) == (direct.value.errno, str(direct.value))

    # Two views in this process: one written, the other unchanged.
    one = dmaload.load(path, cache=service.socket)
    two = dmaload.load(path, cache=True if os.environ.get("DMALOAD_CACHE") else service.socket)
    np.frombuffer(memoryview(one), dtype=np.uint8)[:] = 7
    assert bytes(two) == data
    assert service.memfds() == 1


def test_safetensors_from_the_cache_match_a_direct_load(service: Service, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import numpy as st_numpy

    path = tmp_path / "model.safetensors"
    rng = np.random.default_rng(3)
    st_numpy.save_file(
        {
            "a": rng.standard_normal((300, 77)).astype(np.float32),
            "b": rng.integers(0, 100, (1000,), dtype=np.int64),
            "c": rng.standard_normal((5,)).astype(np.float16),
        },
        path,
    )
    direct = dst.load_file(path)
    cached = dst.load_file(path, cache=service.socket)
    assert direct.keys() == cached.keys()
    for name in direct:
        assert cached[name].dtype == direct[name].dtype
        np.testing.assert_array_equal(cached[name], direct[name])
    # Writes to one client's tensors stay in it.
    pt = dst.load_file(path, framework="pt", cache=service.socket)
    pt["a"].fill_(0)
    again = dst.load_file(path, framework="pt", cache=service.socket)
    assert torch.equal(again["a"], torch.from_numpy(direct["a"]))
    status = service.status()
    assert (status["misses"], status["hits"]) == (1, 2)


def test_iter_tensors_from_the_cache_keeps_what_the_filter_names(service: Service, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "model.safetensors"
    expected = _model(path)
    got = dict(dst.iter_tensors(path, cache=service.socket, tensor_filter=["a", "c"]))
    assert got.keys() == {"a", "c"}
    for name, t in got.items():
        assert torch.equal(t, torch.from_numpy(expected[name]))
    again = dict(dst.iter_tensors(path, cache=service.socket))
    assert again.keys() == expected.keys()
    status = service.status()
    assert (status["misses"], status["hits"]) == (1, 1)


def _model(path: Path) -> dict[str, Any]:
    from safetensors import numpy as st_numpy

    rng = np.random.default_rng(5)
    tensors: dict[str, Any] = {
        "a": rng.standard_normal((300, 77)).astype(np.float32),
        "spans_slots": rng.integers(0, 255, (200_001,), dtype=np.uint8),
        "c": rng.standard_normal((5,)).astype(np.float16),
    }
    st_numpy.save_file(tensors, path)
    return tensors


def test_device_loads_read_the_services_memory_not_the_disk(service: Service, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from dmaload.safetensors import _device

    path = tmp_path / "model.safetensors"
    expected = _model(path)
    dmaload.load(path, cache=service.socket)  # the service holds it now
    dmaload.evict(path)
    ring = {"staging_slots": 2, "staging_slot_size": "64K", "chunk_size": "16K"}
    # device="cpu" runs the device path (a staging ring into one allocation) without a GPU.
    files = _device.load_files([path], "cpu", None, ring, str(service.socket))
    report = files[0].report
    assert report.filesystem == "tmpfs", report  # read from the service's memfd
    assert files[0].path == str(path)
    for name, t in expected.items():
        np.testing.assert_array_equal(files[0].torch(name).numpy(), t)
    status = service.status()
    assert (status["misses"], status["hits"]) == (1, 1)
    # A bad file served from the memfd is named as the file, not the memfd.
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(dst.SafetensorError, match=f"{cut}: invalid safetensors file: file is shorter"):
        _device.load_files([cut], "cpu", None, ring, str(service.socket))


def test_a_cuda_load_through_the_service_is_copied_by_it_into_the_tensors_memory(
    service: Service, tmp_path: Path
) -> None:
    """On a GPU: ``cache=`` with ``device="cuda:0"`` has the service copy
    each file into the memory PyTorch allocated (inside a larger segment of
    its caching allocator, at an offset: a small tensor is allocated first),
    a miss and then a hit; the emulator tests (test_cuda_emulator.py) cover
    the same path, its fallbacks and refusals without one."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("SKIP cuda cache service: PyTorch sees no CUDA device")
    path = tmp_path / "model.safetensors"
    expected = _model(path)
    before = torch.empty(1000, dtype=torch.uint8, device="cuda:0")
    for served in ("miss", "hit"):
        with dst.safe_open(path, framework="pt", device="cuda:0", cache=service.socket) as f:
            report = f.reports[0]
            assert f"via cache-service ({served})" in report.destination and not report.fallbacks, report
            for name, t in expected.items():
                np.testing.assert_array_equal(f.get_tensor(name).cpu().numpy(), t)
    del before


def test_a_device_load_without_a_service_reads_the_file_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    from dmaload.safetensors import _device

    path = tmp_path / "model.safetensors"
    expected = _model(path)
    monkeypatch.setattr("dmaload._cache._said", set())
    with pytest.warns(RuntimeWarning, match="no cache service.*read from the file"):
        files = _device.load_files([path], "cpu", None, {}, str(tmp_path / "absent.sock"))
    assert files[0].report.filesystem != "tmpfs"
    np.testing.assert_array_equal(files[0].torch("a").numpy(), expected["a"])


def test_a_descriptor_is_served_as_its_file_and_a_fifo_is_refused_not_waited_on(
    service: Service, data_file: tuple[Path, bytes], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from dmaload.safetensors import _device

    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = dmaload.load(fd, cache=service.socket)
    finally:
        os.close(fd)
    assert bytes(buf) == data and buf.report.destination.startswith("cache-service")
    # Named as the file the descriptor is open on, not /proc/self/fd/N.
    assert buf.report.path == str(path), buf.report.path
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="FIFO"):
        _device.load_files([fifo], "cpu", None, {}, str(service.socket))


def test_cuda_load_file_from_the_cache_is_bit_exact(service: Service, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("SKIP cuda: PyTorch sees no CUDA device")
    path = tmp_path / "model.safetensors"
    expected = _model(path)
    out = dst.load_file(path, framework="pt", device="cuda:0", cache=service.socket)
    assert service.status()["misses"] == 1
    for name, t in expected.items():
        assert out[name].device.type == "cuda"
        assert torch.equal(out[name].cpu(), torch.from_numpy(t))


def test_cache_takes_a_path_of_bytes_and_names_itself_when_wrong(tmp_path: Path, data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with pytest.warns(RuntimeWarning, match="loaded directly"):
        assert bytes(dmaload.load(path, cache=os.fsencode(tmp_path / "absent.sock"))) == data
    for wrong in (5, 1.5, object()):
        with pytest.raises(TypeError, match="cache= takes True, False, None or a socket path"):
            dmaload.load(path, cache=wrong)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="cache= takes"):
            dst.load_file(path, cache=wrong)  # type: ignore[arg-type]


def test_without_a_service_it_loads_directly_and_says_so_once(
    tmp_path: Path, data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = data_file
    monkeypatch.setattr("dmaload._cache._said", set())
    absent = tmp_path / "absent.sock"
    with pytest.warns(RuntimeWarning, match="no cache service.*loaded directly"):
        buf = dmaload.load(path, cache=absent)
    assert bytes(buf) == data and buf.report.destination == "memfd"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bytes(dmaload.load(path, cache=absent)) == data
        # cache=False, and no DMALOAD_CACHE: no service is asked.
        monkeypatch.delenv("DMALOAD_CACHE", raising=False)
        assert bytes(dmaload.load(path, cache=False)) == data


def test_a_killed_service_leaves_clients_their_bytes_and_a_fallback(
    tmp_path: Path, data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = data_file
    monkeypatch.setattr("dmaload._cache._said", set())
    svc = Service(tmp_path / "cache.sock", "--memory-limit", "64M")
    held = dmaload.load(path, cache=svc.socket)
    assert svc.memfds() == 1
    svc.proc.kill()
    svc.proc.wait(timeout=60)
    assert bytes(held) == data  # the pages outlive the service
    with pytest.warns(RuntimeWarning, match="no cache service"):
        again = dmaload.load(path, cache=svc.socket)
    assert bytes(again) == data


def test_a_malformed_file_from_the_cache_path_is_named_in_the_error(tmp_path: Path) -> None:
    """With cache= the header is parsed from the bytes received (here a
    direct load: no service): its error names the file as a direct load's does."""
    path = tmp_path / "bad.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(dmaload.SafetensorError, match="needs 16 bytes") as expected:
        dst.load_file(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no cache service"
        with pytest.raises(dmaload.SafetensorError) as info:
            dst.load_file(path, cache=tmp_path / "absent.sock")
    assert str(info.value) == str(expected.value)


def test_a_stopped_service_is_a_prompt_fallback(tmp_path: Path, data_file: tuple[Path, bytes]) -> None:
    """A service stopped with SIGSTOP (Ctrl-Z) after it started: the kernel
    still queues the connection, but no acknowledgement comes, and the load
    goes direct within seconds, saying why, instead of waiting for a reply."""
    path, data = data_file
    svc = Service(tmp_path / "cache.sock")
    code = (
        "import sys, warnings, dmaload\n"
        "with warnings.catch_warnings(record=True) as said:\n"
        "    warnings.simplefilter('always')\n"
        "    buf = dmaload.load(sys.argv[1], cache=sys.argv[2])\n"
        "print(buf.report.destination, len(bytes(buf)), '|'.join(str(w.message) for w in said))\n"
    )
    svc.proc.send_signal(signal.SIGSTOP)
    try:
        out = _fresh(code, str(path), str(svc.socket))  # bounded by _fresh's generous timeout
    finally:
        svc.proc.send_signal(signal.SIGCONT)
        svc.stop()
    destination, length, said = out.split(" ", 2)
    assert (destination, int(length)) == ("memfd", len(data)), out
    assert "stopped or stuck" in said and "loaded directly" in said, out


def test_ctrl_c_interrupts_the_wait_for_the_cache_service(tmp_path: Path, data_file: tuple[Path, bytes]) -> None:
    """A service that accepted the request and keeps saying it works on it
    (a long load) holds the client, but a real SIGINT ends the wait with
    KeyboardInterrupt, leaving no descriptor or thread behind."""
    path, _ = data_file
    sock_path = tmp_path / "fake.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(sock_path))
    listener.listen(1)
    code = (
        "import os, signal, sys, dmaload\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored\n"
        "def count(what): return len(os.listdir(f'/proc/self/{what}'))\n"
        "before = count('fd'), count('task')\n"
        "try:\n"
        "    dmaload.load(sys.argv[1], cache=sys.argv[2])\n"
        "    print('LOADED', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('INTERRUPTED', (count('fd'), count('task')) == before, flush=True)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(path), str(sock_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )

    def message(reply: str, **fields: int) -> bytes:
        return json.dumps({"version": 2, "body": {"reply": reply, **fields}}).encode()

    stop_keepalives = False
    try:
        conn, _ = listener.accept()
        with conn:
            request, fds, _, _ = socket.recv_fds(conn, 1024, 4)  # the child now waits for the reply
            for fd in fds:
                os.close(fd)
            assert json.loads(request)["body"] == {"op": "get"}
            conn.send(message("accepted"))
            def keepalives() -> None:
                sent = 0
                while not stop_keepalives:
                    try:
                        conn.send(message("working", loaded=sent))
                        sent += 1  # bytes read: the load is moving
                    except OSError:
                        return
                    time.sleep(0.5)  # the service's pace, not synchronisation

            beat = threading.Thread(target=keepalives, daemon=True)
            beat.start()
            child.send_signal(signal.SIGINT)
            out, err = child.communicate(timeout=60)
            stop_keepalives = True
            beat.join()
    finally:
        if child.poll() is None:
            child.kill()
        listener.close()
    assert out.strip() == "INTERRUPTED True", f"{out}\n{err}"
