"""``dmaload.load``, ``dmaload.load_range`` and ``dmaload.load_dmabuf``."""

from __future__ import annotations

import os
from typing import Union, Unpack

from . import _dmaload
from ._dmaload import Buffer, DmaBuf
from ._options import DmabufLoadOptions, LoadOptions, native_kwargs
from ._progress import Progress, resolve

StrPath = Union[str, "os.PathLike[str]"]


def load(path: StrPath, *, progress: Progress = None, **options: Unpack[LoadOptions]) -> Buffer:
    """Loads the whole file at ``path`` into a new :class:`Buffer`.

    The GIL is released while the file is read. Errors are ``OSError`` with
    ``errno`` and ``filename`` set (``FileNotFoundError`` and friends), the
    message naming the operation and, where known, the file offset.
    ``progress`` is a callable ``(bytes_done, bytes_total)`` or ``True`` for
    a tqdm bar (when tqdm is installed). ``to`` is the host memory the
    buffer lives in (``"memfd"``, ``"anonymous-thp"``); a device
    (``"cuda:N"``) is refused with ``OSError`` EINVAL, as a Buffer cannot
    live there: ``dmaload.safetensors`` loads onto a GPU with ``device=``.
    """
    callback, finish = resolve(progress, os.path.basename(os.fspath(path)))
    try:
        return _dmaload.load(path, progress=callback, **native_kwargs(dict(options)))
    finally:
        finish()


def load_range(
    path: StrPath,
    offset: int,
    length: int | None = None,
    *,
    progress: Progress = None,
    **options: Unpack[LoadOptions],
) -> Buffer:
    """Loads ``length`` bytes of ``path`` from byte ``offset`` (to the end of
    the file when ``length`` is None). Neither needs any alignment; a range
    past the end of the file is an ``OSError`` (ENODATA)."""
    if offset < 0 or (length is not None and length < 0):
        raise ValueError("offset and length must be non-negative")
    callback, finish = resolve(progress, os.path.basename(os.fspath(path)))
    try:
        return _dmaload.load(path, offset, length, progress=callback, **native_kwargs(dict(options)))
    finally:
        finish()


def load_dmabuf(
    path: StrPath,
    offset: int = 0,
    length: int | None = None,
    *,
    to: str = "dmabuf",
    **options: Unpack[DmabufLoadOptions],
) -> DmaBuf:
    """Loads ``length`` bytes of ``path`` from ``offset`` (the whole file by
    default) into a new dma-buf, seed 000's alloc-and-read: ``to`` is
    ``"udmabuf"`` (a memfd loaded in place, exported without copy),
    ``"dma-heap:NAME"`` (allocated from ``/dev/dma_heap/NAME`` beside the
    reads, filled through a staging ring) or ``"dmabuf"`` (udmabuf where it
    exists and can hold the range, else ``dma-heap:system``;
    ``report.destination`` and ``report.fallbacks`` say which and why).

    The :class:`DmaBuf` owns the fd (``fileno()``) until ``close()`` or
    ``detach()``. Errors are ``OSError`` as for :func:`load`: an unknown heap
    or a kernel without udmabuf is EINVAL naming the device's path."""
    if offset < 0 or (length is not None and length < 0):
        raise ValueError("offset and length must be non-negative")
    return _dmaload.load_dmabuf(path, offset, length, to=to, **native_kwargs(dict(options)))
