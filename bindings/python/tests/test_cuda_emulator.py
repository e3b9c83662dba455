"""The staged CUDA path (``_load_staged`` to device pointers) without a GPU:
against the CUDA driver emulator in tests/cuda-emu, in strict mode, in a
child process (``DMALOAD_LIBCUDA`` is read once per process, and torch's
own CUDA runtime must not see the emulator). The device memory is
allocated with the emulator's ``cuMemAlloc`` through ctypes and read back
with ``cuMemcpyDtoH``. What needs torch's CUDA runtime
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
