"""``verify=True``: every file checked against the ``SHA256SUMS`` beside it
(written here by coreutils' ``sha256sum``) or the ``B3SUMS`` (written by
``b3sum``), hashed as the bytes arrive; a
flipped byte, a missing sums file or an unlisted file is an OSError and
hands out no buffer or tensors."""

from __future__ import annotations

import errno
import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dmaload
import dmaload.safetensors as dst
from conftest import write_random

st_numpy = pytest.importorskip("safetensors.numpy")


def _sums(directory: Path, *names: str) -> None:
    out = subprocess.run(["sha256sum", *names], cwd=directory, check=True, capture_output=True).stdout
    (directory / "SHA256SUMS").write_bytes(out)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_load_verifies_and_a_flipped_byte_is_ebadmsg(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    data = write_random(path, (5 << 20) + 123)
    _sums(tmp_path, "weights.bin")
    with dmaload.load(path, verify=True) as buffer:
        assert bytes(memoryview(buffer)) == data
    expected = hashlib.sha256(data).hexdigest()
    _flip(path, 4 << 20)
    computed = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(OSError) as raised:
        dmaload.load(path, verify=True)
    assert raised.value.errno == errno.EBADMSG
    message = str(raised.value)
    assert "weights.bin" in message and expected in message and computed in message


def test_b3sums_verify_a_sharded_safetensors_load(tmp_path: Path) -> None:
    """A B3SUMS written by ``b3sum`` verifies every shard; a flipped byte in
    one fails the whole load naming BLAKE3, its file and B3SUMS."""
    if shutil.which("b3sum") is None:
        pytest.skip("b3sum is not installed (apt-get install b3sum)")
    names = []
    for i in range(2):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        st_numpy.save_file({f"w{i}": np.arange(300_000, dtype=np.float32) * (i + 1)}, str(tmp_path / name))
        names.append(name)
    out = subprocess.run(["b3sum", *names], cwd=tmp_path, check=True, capture_output=True).stdout
    (tmp_path / "B3SUMS").write_bytes(out)
    tensors = dst.load_file(tmp_path, framework="np", verify=True)
    assert sorted(tensors) == ["w0", "w1"]
    _flip(tmp_path / names[1], 200_000)
    with pytest.raises(OSError) as raised:
        dst.load_file(tmp_path, framework="np", verify=True)
    assert raised.value.errno == errno.EBADMSG
    message = str(raised.value)
    assert "BLAKE3 mismatch" in message and names[1] in message and "B3SUMS" in message


def test_a_missing_sums_file_or_an_unlisted_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_random(path, 100_000)
    with pytest.raises(OSError) as raised:
        dmaload.load(path, verify=True)
    assert raised.value.errno == errno.EINVAL and "SHA256SUMS" in str(raised.value)
    (tmp_path / "g").write_bytes(b"g")
    _sums(tmp_path, "g")
    with pytest.raises(OSError, match="is not listed"):
        dmaload.load(path, verify=True)


def test_a_sharded_model_with_one_corrupt_shard_gives_no_tensors(tmp_path: Path) -> None:
    names = []
    for i in range(3):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        tensors = {f"layer{i}.w": np.arange(4096, dtype=np.float32) * (i + 1)}
        st_numpy.save_file(tensors, tmp_path / name)
        names.append(name)
    _sums(tmp_path, *names)
    for framework in ("np", "pt"):
        out = dst.load_file(tmp_path, framework=framework, verify=True)
        assert set(out) == {"layer0.w", "layer1.w", "layer2.w"}
    corrupt = tmp_path / names[1]
    _flip(corrupt, corrupt.stat().st_size - 5)  # a tensor byte: the header still parses
    assert len(dst.load_file(tmp_path)) == 3  # unverified, it loads silently
    for concurrency in (1, 3):
        with pytest.raises(OSError) as raised:
            dst.load_file(tmp_path, verify=True, concurrency=concurrency)
        assert raised.value.errno == errno.EBADMSG and names[1] in str(raised.value)


def test_load_into_the_callers_memory_verifies_a_whole_file(tmp_path: Path) -> None:
    """``load_into(..., verify=True)`` of a whole file into a bytearray (any
    address: through the staging ring) or a page-aligned numpy array (in
    place) checks it; a flipped byte is EBADMSG; a part of the file is
    refused (EINVAL) before anything is read."""
    path = tmp_path / "weights.bin"
    data = write_random(path, (3 << 20) + 4097)
    _sums(tmp_path, "weights.bin")
    raw = np.zeros(len(data) + 8192, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096
    aligned, shifted = raw[start : start + len(data)], raw[start + 100 : start + 100 + len(data)]
    targets: list[Any] = [bytearray(len(data)), aligned, shifted]
    for target in targets:
        dmaload.load_into(path, target, verify=True)
        assert bytes(target) == data
    _flip(path, 2 << 20)
    for target in targets:
        with pytest.raises(OSError) as raised:
            dmaload.load_into(path, target, verify=True)
        assert raised.value.errno == errno.EBADMSG, raised.value
    with pytest.raises(OSError) as raised:
        dmaload.load_into(path, bytearray(4096), 4096, verify=True)
    assert raised.value.errno == errno.EINVAL and "cannot be checked" in str(raised.value)
