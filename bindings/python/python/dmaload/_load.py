"""``dmaload.load``, ``load_range``, ``load_into`` and ``load_dmabuf``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol, Union, Unpack

from . import _dmaload
from ._buffer import release_views
from ._cache import Cache, load_cached, socket_for
from ._dmaload import Buffer, DmaBuf
from ._options import DmabufLoadOptions, LoadOptions, native_options
from ._progress import Progress, resolve
from ._report import LoadReport

StrPath = Union[str, "os.PathLike[str]"]


class HasFileno(Protocol):
    def fileno(self) -> int: ...


FileArg = Union[StrPath, int, HasFileno]
"""A path, a descriptor open for reading (an int), or an open file object:
the file is reopened through ``/proc/self/fd``, so the caller's descriptor
and its offset are never changed."""


def _file(file: FileArg) -> StrPath | int:
    """The path or the descriptor number of ``file``."""
    if isinstance(file, bool):
        raise TypeError("a file must be a path, a descriptor (int) or an open file, not a bool")
    if isinstance(file, (str, int, os.PathLike)):
        return file
    return file.fileno()


def _name(file: StrPath | int) -> str:
    """How progress bars name the file."""
    return f"fd {file}" if isinstance(file, int) else os.path.basename(os.fspath(file))


def load(
    path: FileArg, *, progress: Progress = None, cache: Cache = None, **options: Unpack[LoadOptions]
) -> Buffer:
    """Loads the whole file at ``path`` into a new :class:`Buffer`.

    ``path`` may also be a descriptor open for reading (an int) or an open
    file object: the file is opened once, through ``/proc/self/fd`` for a
    descriptor, and the caller's descriptor and its offset stay as they were.
    An ``s3://BUCKET/KEY`` URL loads an object from an S3-compatible store
    (settings from ``AWS_*`` variables and ``~/.aws``; docs/object-storage.md).

    The GIL is released while the file is read. Errors are ``OSError`` with
    ``errno`` and ``filename`` set (``FileNotFoundError`` and friends), the
    message naming the operation and, where known, the file offset.
    ``progress`` is a callable ``(bytes_done, bytes_total)`` or ``True`` for
    a tqdm bar (when tqdm is installed). ``to`` is the host memory the
    buffer lives in (``"memfd"``, ``"anonymous"``, ...); a device
    (``"cuda:N"``) is refused with ``OSError`` EINVAL, as a Buffer cannot
    live there: ``dmaload.safetensors`` loads onto a GPU with ``device=``.

    ``cache=True`` (or a socket path; ``DMALOAD_CACHE=1`` or a socket path
    in the environment does the same) gets the file from the model-cache
    service (``dmaload serve``): the same bytes, as a private copy-on-write
    mapping of the service's memory, without reading the disk when the
    service holds the file. Without a service it loads directly and says
    so once (``RuntimeWarning``); ``progress`` is not called for a file
    the service serves. An ``s3://`` object is served the same way: the
    service reads it with presigned queries from this process (its keys
    stay here) and keeps it under its ETag, so the next load of the same
    version maps it after a HEAD, without a GET.

    A process forked after the load gets its own copy of the buffer's
    bytes: see :class:`Buffer`.
    """
    file = _file(path)
    socket = socket_for(cache)
    if socket is not None:
        return load_cached(file, socket, native_options(options))
    callback, finish = resolve(progress, _name(file))
    try:
        return _dmaload.load(file, options=native_options(options), progress=callback)
    finally:
        finish()


def load_range(
    path: FileArg,
    offset: int,
    length: int | None = None,
    *,
    progress: Progress = None,
    **options: Unpack[LoadOptions],
) -> Buffer:
    """Loads ``length`` bytes of ``path`` from byte ``offset`` (to the end of
    the file when ``length`` is None). Neither needs any alignment; a range
    past the end of the file is an ``OSError`` (ENODATA). ``path`` may be a
    descriptor or an open file, as for :func:`load`."""
    if offset < 0 or (length is not None and length < 0):
        raise ValueError("offset and length must be non-negative")
    file = _file(path)
    callback, finish = resolve(progress, _name(file))
    try:
        return _dmaload.load(file, offset, length, options=native_options(options), progress=callback)
    finally:
        finish()


def load_into(
    path: StrPath,
    target: Any,
    offset: int = 0,
    *,
    progress: Progress = None,
    arrived: Callable[[int], object] | None = None,
    **options: Unpack[LoadOptions],
) -> LoadReport:
    """Fills ``target``, memory the caller already has, with as many bytes
    of ``path`` as it holds, from byte ``offset``; returns the report.

    ``target`` is any writable C-contiguous buffer: a ``bytearray``, a numpy
    array, ``tensor.numpy()`` of a CPU tensor, a :class:`Buffer`'s
    ``memoryview``. Where its address lines up with the file offset (modulo
    the direct-I/O alignment: page-aligned memory and an aligned offset, for
    instance) the file is read straight into it; otherwise through a small
    staging ring, one copy (``report.destination`` says which). A range past
    the end of the file is an ``OSError`` (ENODATA); after any error the
    memory holds a mix of old and new bytes. ``to`` is refused: ``target`` is
    the destination.

    ``arrived(n)``, called from a thread of the load while it runs, says
    that bytes ``0..n`` of ``target`` already hold the file's bytes (the
    file unchanged so far), so another thread may use them before the load
    returns: gather by gather where the file is read straight into
    ``target`` from its first byte, else once at the end; the last call
    has the whole length. An exception it raises cancels the load and is
    raised here. Bytes said to have arrived stay as said, but a load that
    then fails still fails whole.
    """
    if offset < 0:
        raise ValueError("offset must be non-negative")
    native = native_options(options)
    callback, finish = resolve(progress, os.path.basename(os.fspath(path)))
    # Bytes of any element type: a C-contiguous view casts to unsigned bytes
    # (a writable one with a 0 in its shape cannot be cast, and holds none).
    try:
        view = raw = memoryview(target)
        try:
            raw = view.cast("B") if view.nbytes or view.readonly else memoryview(bytearray())
            return _dmaload.load_into(path, raw, offset, options=native, progress=callback, arrived=arrived)
        finally:
            release_views(raw, view)
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
    ``path`` may be an ``s3://BUCKET/KEY`` object: its GETs fill the
    dma-buf as a file's reads do.

    The :class:`DmaBuf` owns the fd (``fileno()``) until ``close()`` or
    ``detach()``. Errors are ``OSError`` as for :func:`load`: an unknown heap
    or a kernel without udmabuf is EINVAL naming the device's path."""
    if offset < 0 or (length is not None and length < 0):
        raise ValueError("offset and length must be non-negative")
    return _dmaload.load_dmabuf(path, offset, length, options={**native_options(options), "to": to})
