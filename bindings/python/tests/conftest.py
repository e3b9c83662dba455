"""Shared helpers of the dmaload Python tests."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def write_random(path: Path, size: int, seed: int = 1) -> bytes:
    data = (
        os.urandom(0)
        if size == 0
        else __import__("numpy").random.default_rng(seed).integers(0, 256, size, dtype="uint8").tobytes()
    )
    path.write_bytes(data)
    return data


def run_beside_a_spinner(call: Callable[[], Any], what: str) -> Any:
    """Runs ``call`` while a second Python thread ticks about every
    millisecond, and asserts it kept ticking throughout: ``call`` released
    the GIL. Returns what ``call`` returned."""
    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.02)
    try:
        start = time.perf_counter()
        result = call()
        end = time.perf_counter()
    finally:
        stop.set()
        t.join()
    duration = end - start
    inside = [s for s in stamps if start <= s <= end]
    # With the GIL held for the whole call the spinner would stall for all
    # of it; released, it ticks about every millisecond throughout.
    assert duration > 0.05, f"{what} too fast ({duration:.3f} s) to judge"
    assert len(inside) >= max(5, int(duration / 0.001 * 0.2)), (len(inside), duration)
    gaps = [b - a for a, b in zip([start, *inside], [*inside, end])]
    assert max(gaps) < duration / 2, (max(gaps), duration)
    return result


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A 3 MiB + 123 bytes file of random bytes (an unaligned tail)."""
    path = tmp_path / "data.bin"
    return path, write_random(path, (3 << 20) + 123)
