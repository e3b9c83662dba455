"""Progress reporting: a user callback, or a tqdm bar for ``progress=True``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

ProgressCallback = Callable[[int, int], Any]
Progress = Union[bool, ProgressCallback, None]


class _Bar:
    """Feeds (done, total) byte counts to a tqdm bar."""

    def __init__(self, desc: str) -> None:
        from tqdm.auto import tqdm  # type: ignore[import-untyped,unused-ignore]

        self.bar = tqdm(total=None, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)

    def __call__(self, done: int, total: int) -> None:
        if self.bar.total != total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def resolve(progress: Progress, desc: str) -> tuple[ProgressCallback | None, Callable[[], None]]:
    """The native callback for ``progress`` and a function to call when done.

    ``True`` shows a tqdm bar when tqdm is installed and nothing otherwise;
    a callable gets ``(bytes_done, bytes_total)`` at most every 50 ms and
    once at the end, from the loading threads (with the GIL held).
    """
    if progress is None or progress is False:
        return None, lambda: None
    if progress is True:
        try:
            bar = _Bar(desc)
        except ImportError:
            return None, lambda: None
        return bar, bar.close
    if not callable(progress):
        raise TypeError(f"progress must be a bool or a callable(done, total), not {type(progress).__name__}")
    return progress, lambda: None
