"""The staged CUDA path (``_load_staged`` to device pointers) without a GPU:
against the CUDA driver emulator in tests/cuda-emu, in strict mode, in a
child process (``DMALOAD_LIBCUDA`` is read once per process, and torch's
own CUDA runtime must not see the emulator). The device memory is
allocated with the emulator's ``cuMemAlloc`` through ctypes and read back
with ``cuMemcpyDtoH``. The cache-service cases run ``dmaload serve`` on
the same emulated device (another process, as in production), which opens
the child's memory through its CUDA IPC handle. What needs torch's CUDA runtime
(``torch.empty(device="cuda")``, ``load_file(device="cuda:0")``) cannot be
emulated and stays GPU-only, in test_device.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# The child: loads argv[1]'s data section into emulated device memory
# through a two-slot ring, prints OK or the error, then how many bytes of
# staging ring were kept for the next load.
CHILD = r"""
import ctypes, json, os, struct, sys
import dmaload
from dmaload import _dmaload

cuda = ctypes.CDLL(os.environ["DMALOAD_LIBCUDA"])
def check(code):
    assert code == 0, code
check(cuda.cuInit(0))
device, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cuda.cuDeviceGet(ctypes.byref(device), 0))
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
check(cuda.cuCtxPushCurrent_v2(ctx))
path = sys.argv[1]
data = open(path, "rb").read()
start = 8 + struct.unpack("<Q", data[:8])[0]
file = _dmaload.open_safetensors(path)
n = file.data_len
dptr = ctypes.c_ulonglong()
check(cuda.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(n)))
ring = {"staging_slots": 2, "staging_slot_size": 65536, "chunk_size": 65536}
ring.update(json.loads(os.environ.get("CHILD_OPTIONS", "{}")))
ring = {name: value for name, value in ring.items() if value is not None}
try:
    _dmaload._load_staged([file], [dptr.value], 0, options=ring)
except OSError as err:
    print("ERROR", err.errno, err)
else:
    back = ctypes.create_string_buffer(n)
    check(cuda.cuMemcpyDtoH_v2(back, dptr, ctypes.c_size_t(n)))
    print("OK" if back.raw == data[start:start + n] else "DIFFERENT")
print("KEPT", dmaload.safetensors.release_staging())
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> str:
    reason = None
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        reason = "no C compiler to build the CUDA emulator"
    if reason is not None:
        if os.environ.get("DMALOAD_TEST_NO_SKIP") == "1":
            pytest.fail(reason)
        pytest.skip(f"SKIP cuda emulator: {reason}")
    out = tmp_path_factory.mktemp("cuda-emu")
    subprocess.run(["bash", str(ROOT / "tests/cuda-emu/build.sh"), str(out)], check=True)
    return str(out / "libcuda.so.1")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("model") / "m.safetensors"
    rng = np.random.default_rng(5)
    # 600 KiB of data: ten fills of each of the two 64 KiB slots.
    save_file({"a": rng.integers(0, 255, 300_001, dtype=np.uint8), "b": rng.random(37_000)}, str(path))
    return path


def _child(emulator: str, model: Path, faults: str = "", options: str = "{}") -> str:
    env = dict(os.environ, DMALOAD_LIBCUDA=emulator, DMALOAD_EMU_STRICT="1", DMALOAD_EMU_FAULTS=faults)
    env["CHILD_OPTIONS"] = options
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_staged_load_to_emulated_device_memory_is_bit_exact(emulator: str, model: Path) -> None:
    out = _child(emulator, model)
    assert "OK\n" in out and "KEPT 131072" in out, out


def test_the_ring_holds_a_quarter_of_the_data_as_the_cores_device_loads_do(emulator: str, model: Path) -> None:
    # 600 KiB of data in 64 KiB slots fills 10: a quarter is 3, so the
    # ring's floor of 8 slots applies (not the 32 it pinned whatever the size).
    out = _child(emulator, model, options='{"staging_slots": null}')
    assert "OK\n" in out and f"KEPT {8 * 65536}" in out, out


def test_a_sticky_device_error_fails_the_load_and_the_ring_is_not_kept(emulator: str, model: Path) -> None:
    out = _child(emulator, model, "copy#3=sticky:700")
    assert "ERROR 5 " in out and str(model) in out and "offset" in out, out
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in out, out
    assert "KEPT 0" in out, out


def test_a_failed_copy_call_fails_the_load_and_the_ring_is_kept(emulator: str, model: Path) -> None:
    out = _child(emulator, model, "cuMemcpyHtoDAsync_v2#4=999")
    assert "ERROR 5 " in out and str(model) in out and "CUDA_ERROR_UNKNOWN" in out, out
    # Not sticky: the context still works, so its idle ring serves the next load.
    assert "KEPT 131072" in out, out


def test_a_verified_staged_load_checks_the_header_and_the_data_it_put_on_the_device(
    emulator: str, tmp_path: Path
) -> None:
    """``verify=True`` on the staged device path: the header is read to size
    the device memory, then only the data section goes through the ring;
    the digest covers both, in file order. An intact file loads; a flipped
    data byte, or a blank of the header's JSON turned into a tab (the header
    still parses), is an OSError (EBADMSG) naming the digests."""
    header = json.dumps({"a": {"dtype": "U8", "shape": [400_000], "data_offsets": [0, 400_000]}}).encode()
    data = bytes(i * 13 % 251 for i in range(400_000))
    path = tmp_path / "m.safetensors"
    original = struct.pack("<Q", len(header)) + header + data
    path.write_bytes(original)
    sums = subprocess.run(["sha256sum", path.name], cwd=tmp_path, check=True, capture_output=True).stdout
    (tmp_path / "SHA256SUMS").write_bytes(sums)
    verify = json.dumps({"verify": True})
    out = _child(emulator, path, options=verify)
    assert "OK\n" in out and "ERROR" not in out, out
    flipped = bytearray(original)
    flipped[-1000] ^= 1
    path.write_bytes(bytes(flipped))
    out = _child(emulator, path, options=verify)
    assert f"ERROR {errno.EBADMSG} " in out and "SHA-256 mismatch" in out, out
    blank = original.index(b" ", 8)
    path.write_bytes(original[:blank] + b"\t" + original[blank + 1 :])
    out = _child(emulator, path, options=verify)
    assert f"ERROR {errno.EBADMSG} " in out, out


# The child of the cache-service cases: one allocation of `lead` bytes, the
# whole file, and `tail` bytes (a tensor inside a caching allocator's
# larger segment), filled with 0x5a; `_load_staged(..., socket=)` into the
# data section's place; then which parts hold what, and the report.
SERVICE_CHILD = r"""
import ctypes, os, sys
from dmaload import _dmaload

cuda = ctypes.CDLL(os.environ["DMALOAD_LIBCUDA"])
def check(code):
    assert code == 0, code
ordinal = int(os.environ.get("CHILD_DEVICE", "0"))
check(cuda.cuInit(0))
device, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cuda.cuDeviceGet(ctypes.byref(device), ordinal))
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
check(cuda.cuCtxPushCurrent_v2(ctx))
path, socket, lead, tail = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
data = open(path, "rb").read()
file = _dmaload.open_safetensors(path)
size = lead + len(data) + tail
dptr = ctypes.c_ulonglong()
check(cuda.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(size)))
check(cuda.cuMemsetD8_v2(dptr, ctypes.c_ubyte(0x5A), ctypes.c_size_t(size)))
ring = {"staging_slots": 2, "staging_slot_size": 65536, "chunk_size": 65536}
try:
    target = dptr.value + lead + file.data_start
    [report] = _dmaload._load_staged([file], [target], ordinal, options=ring, socket=socket)
except OSError as err:
    print("ERROR", err.errno, err)
else:
    print("DESTINATION", report.destination)
    for fallback in report.fallbacks:
        print("FALLBACK", fallback.from_, "->", fallback.to, fallback.reason)
back = ctypes.create_string_buffer(size)
check(cuda.cuMemcpyDtoH_v2(back, dptr, ctypes.c_size_t(size)))
raw, start = back.raw, lead + file.data_start
print("DATA", "same" if raw[start:lead + len(data)] == data[file.data_start:] else "other")
print("HEADER", "same" if raw[lead:start] == data[:file.data_start] else "other")
print("AROUND", "untouched" if set(raw[:lead] + raw[lead + len(data):]) <= {0x5A} else "written")
"""

# The client's own driver refuses to pin or copy: a load that succeeds
# through the service proves the client did neither.
CLIENT_PINS_NOTHING = "cuMemHostRegister_v2#1=999,cuMemcpyHtoDAsync_v2#1=999"


def _serve(emulator: str, socket_path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    cli = ROOT / "target" / "release" / "dmaload"
    if not cli.is_file():
        if os.environ.get("DMALOAD_TEST_NO_SKIP") == "1":
            pytest.fail("the dmaload CLI is not built")
        pytest.skip("SKIP cache service on the emulator: the dmaload CLI is not built (cargo build --release)")
    env = dict(os.environ, DMALOAD_LIBCUDA=emulator, DMALOAD_EMU_STRICT="1", **env)
    command = [str(cli), "serve", "--socket", str(socket_path)]
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not socket_path.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the service did not start"
        time.sleep(0.01)
    return proc


def _through_service(
    emulator: str,
    model: Path,
    tmp_path: Path,
    lead: int,
    tail: int,
    service_env: dict[str, str],
    client_env: dict[str, str],
) -> str:
    """``SERVICE_CHILD`` against a service of its own: the child's output."""
    socket_path = tmp_path / "cache.sock"
    service = _serve(emulator, socket_path, service_env)
    try:
        env = dict(os.environ, DMALOAD_LIBCUDA=emulator, DMALOAD_EMU_STRICT="1", **client_env)
        out = subprocess.run(
            [sys.executable, "-c", SERVICE_CHILD, str(model), str(socket_path), str(lead), str(tail)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        service.kill()
        service.wait()
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_cache_service_copies_a_file_into_a_span_inside_a_larger_allocation_bit_exact(
    emulator: str, model: Path, tmp_path: Path
) -> None:
    """A target at a non-zero offset of its allocation (PyTorch's tensors
    lie inside larger segments): the service copies the whole file there,
    header and data, and writes nothing around it; the client pins and
    copies nothing (its driver would refuse)."""
    client = {"DMALOAD_EMU_FAULTS": CLIENT_PINS_NOTHING}
    out = _through_service(emulator, model, tmp_path, 4096 + 123, 777, {}, client)
    assert "via cache-service (miss)" in out and "FALLBACK" not in out, out
    assert "DATA same" in out and "HEADER same" in out and "AROUND untouched" in out, out


def test_a_target_past_the_end_of_its_allocation_is_refused_and_nothing_written(
    emulator: str, model: Path, tmp_path: Path
) -> None:
    out = _through_service(emulator, model, tmp_path, 512, -1, {}, {})
    assert f"ERROR {errno.EINVAL} " in out and "past the end of their allocation" in out, out
    assert "DATA other" in out and "HEADER other" in out and "AROUND untouched" in out, out


OPEN = "open the client's device memory"


@pytest.mark.parametrize(
    ("service_env", "client_env", "cause"),
    [
        ({"DMALOAD_EMU_FAULTS": "cuIpcOpenMemHandle_v2#1=800"}, {}, (OPEN, "CUDA_ERROR_NOT_PERMITTED")),
        # The client's cuda:1 is a device the service does not have.
        ({"DMALOAD_EMU_DEVICES": "1"}, {"DMALOAD_EMU_DEVICES": "2", "CHILD_DEVICE": "1"}, (OPEN, "cuda:1")),
        # No handle for the memory (as for PyTorch's expandable segments).
        ({}, {"DMALOAD_EMU_FAULTS": "cuIpcGetMemHandle#1=1"}, ("cannot be shared with the service",)),
    ],
)
def test_where_the_service_cannot_open_the_memory_the_file_is_staged_and_the_report_says_why(
    emulator: str,
    model: Path,
    tmp_path: Path,
    service_env: dict[str, str],
    client_env: dict[str, str],
    cause: tuple[str, ...],
) -> None:
    out = _through_service(emulator, model, tmp_path, 64, 64, service_env, client_env)
    assert out.startswith("DESTINATION ") and "via cache-service" not in out, out
    # The first fallback: the service was passed over before the load began.
    fallback = next(line for line in out.splitlines() if line.startswith("FALLBACK"))
    assert fallback.startswith("FALLBACK cache-service -> staged"), out
    assert all(part in fallback for part in cause), out
    assert "DATA same" in out and "AROUND untouched" in out, out


def test_the_free_memory_check_python_makes_before_allocating_is_the_cores(emulator: str) -> None:
    """``load_file(device="cuda:N")`` checks the device's free memory with
    the core's check (the one ``dmaload load --to cuda:N`` makes) before
    PyTorch allocates: a load that fits passes, one that does not is
    ENOMEM naming both figures, on an emulated device of 64 MiB."""
    code = r"""
from dmaload import _dmaload
_dmaload.check_device_memory(0, 1 << 20, "m.safetensors")
print("FITS")
try:
    _dmaload.check_device_memory(0, 65 << 20, "2 files from m.safetensors")
except OSError as err:
    print("ERROR", err.errno, err)
"""
    env = dict(os.environ, DMALOAD_LIBCUDA=emulator, DMALOAD_EMU_STRICT="1", DMALOAD_EMU_MEMORY_MIB="64")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("FITS\n"), out.stdout
    assert f"ERROR {errno.ENOMEM} " in out.stdout and "2 files from m.safetensors" in out.stdout, out.stdout
    assert f"needs {65 << 20} bytes on cuda:0 but only {64 << 20} are free" in out.stdout, out.stdout
