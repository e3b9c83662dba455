"""``dmaload.save``: a buffer written to a file, as fast as ``load`` reads one."""

from __future__ import annotations

import os
from typing import Any, Union, Unpack

from . import _dmaload
from ._buffer import release_views
from ._options import SaveOptions, native_save_options
from ._progress import Progress, resolve
from ._report import SaveReport

StrPath = Union[str, "os.PathLike[str]"]


def save(data: Any, path: StrPath, *, progress: Progress = None, **options: Unpack[SaveOptions]) -> SaveReport:
    """Writes the bytes of ``data`` to ``path``; returns the report.

    ``data`` is any C-contiguous buffer: ``bytes``, a ``bytearray``, a
    ``memoryview``, a numpy array, ``tensor.numpy()`` of a CPU tensor, a
    :class:`Buffer`. Its bytes are written where they are, without a copy,
    with the GIL released; the object is held exported meanwhile (a
    ``bytearray`` cannot resize, a :class:`Buffer` cannot close). A
    non-contiguous array is a ``BufferError``: save ``numpy.ascontiguousarray(a)``.
    Bytes another thread changes during the save are saved as they are
    when the kernel reads them.

    A regular file (or a new one) is replaced atomically: the bytes go to a
    temporary file in the same directory (O_DIRECT where the filesystem and
    the data's alignment allow), which is fsynced (``sync=True``, the
    default), then renamed over ``path``. A failed save leaves the old file
    as it was and no temporary file behind. A block device, character
    device or FIFO is written in place; a FIFO with no reader is an error
    at once, not a wait. Symbolic links are followed (``report.target``).

    Errors are ``OSError`` with ``errno`` and ``filename`` set
    (``FileNotFoundError`` for a missing directory, ``IsADirectoryError``,
    ...), the message naming the operation. An unknown option or a wrong
    type is a ``TypeError`` naming it, an unknown ``engine`` or ``mode`` or
    a malformed size a ``ValueError``; a count out of range is the core's
    ``OSError`` (EINVAL), as for :func:`load`. ``progress`` is a callable
    ``(bytes_written, bytes_total)`` or ``True`` for a tqdm bar, as for
    :func:`load`; the last call, ``(total, total)``, comes once the file
    is complete. Ctrl-C stops a save midway (a FIFO or device that waits
    for room included) and raises ``KeyboardInterrupt``, and an exception
    the callback raises stops it the same way and is raised: either way the
    save ends as a failed one does (the old file as it was, no temporary
    file; a FIFO or device keeps the bytes it took).
    """
    sync, native = native_save_options(options)
    callback, finish = resolve(progress, os.path.basename(os.fspath(path)))
    try:
        view = raw = memoryview(data)
        try:
            if not view.c_contiguous:
                raise BufferError("dmaload.save needs a C-contiguous buffer (numpy.ascontiguousarray copies one)")
            # Bytes of any element type: a C-contiguous view casts to unsigned
            # bytes (but for one with a 0 in its shape, which has none).
            raw = view.cast("B") if view.nbytes else memoryview(b"")
            return _dmaload.save(raw, path, sync=sync, options=native, progress=callback)
        finally:
            release_views(raw, view)
    finally:
        finish()
