"""Shared helpers of the dmaload Python tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def write_random(path: Path, size: int, seed: int = 1) -> bytes:
    data = (
        os.urandom(0)
        if size == 0
        else __import__("numpy").random.default_rng(seed).integers(0, 256, size, dtype="uint8").tobytes()
    )
    path.write_bytes(data)
    return data


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A 3 MiB + 123 bytes file of random bytes (an unaligned tail)."""
    path = tmp_path / "data.bin"
    return path, write_random(path, (3 << 20) + 123)
