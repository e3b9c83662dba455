"""Shared helpers of the dmaload Python tests."""

from __future__ import annotations

import faulthandler
import os
import threading
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


def run_beside_a_python_thread(call: Callable[[Callable[[int, int], None]], Any], what: str) -> Any:
    """Runs ``call(progress)`` and asserts that another Python thread ran
    while it did, so ``call`` released the GIL: the first progress report
    made on a thread of the core's (a load reports from its own thread,
    the last report included, before it returns) waits for a second Python
    thread to answer. Neither could run while ``call`` held the GIL; the
    process would then hang, so faulthandler ends it (with every thread's
    traceback) instead. No clock is read: the waits' timeouts only bound a
    failure. Returns what ``call`` returned."""
    in_call = threading.Event()
    answered = threading.Event()
    seen: list[bool] = []

    def progress(done: int, total: int) -> None:
        if threading.current_thread() is not threading.main_thread() and not in_call.is_set():
            in_call.set()
            seen.append(answered.wait(timeout=300))

    def answer() -> None:
        if in_call.wait(timeout=300) and not seen:
            answered.set()

    other = threading.Thread(target=answer)
    other.start()
    faulthandler.dump_traceback_later(600, exit=True)
    try:
        result = call(progress)
    finally:
        faulthandler.cancel_dump_traceback_later()
        in_call.set()
        other.join()
    assert seen == [True], f"{what}: no other Python thread ran in the middle of it (reports: {seen})"
    return result


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A 3 MiB + 123 bytes file of random bytes (an unaligned tail)."""
    path = tmp_path / "data.bin"
    return path, write_random(path, (3 << 20) + 123)
