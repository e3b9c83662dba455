"""``dmaload.load`` and ``dmaload.load_range``."""

from __future__ import annotations

import os
from typing import Union, Unpack

from . import _dmaload
from ._cache import Cache, load_cached, socket_for
from ._dmaload import Buffer
from ._options import LoadOptions, native_kwargs
from ._progress import Progress, resolve

StrPath = Union[str, "os.PathLike[str]"]


def load(
    path: StrPath, *, progress: Progress = None, cache: Cache = None, **options: Unpack[LoadOptions]
) -> Buffer:
    """Loads the whole file at ``path`` into a new :class:`Buffer`.

    The GIL is released while the file is read. Errors are ``OSError`` with
    ``errno`` and ``filename`` set (``FileNotFoundError`` and friends), the
    message naming the operation and, where known, the file offset.
    ``progress`` is a callable ``(bytes_done, bytes_total)`` or ``True`` for
    a tqdm bar (when tqdm is installed). ``to`` is the host memory the
    buffer lives in (``"memfd"``, ``"anonymous-thp"``); a device
    (``"cuda:N"``) is refused with ``OSError`` EINVAL, as a Buffer cannot
    live there: ``dmaload.safetensors`` loads onto a GPU with ``device=``.

    ``cache=True`` (or a socket path; ``DMALOAD_CACHE=1`` or a socket path
    in the environment does the same) gets the file from the model-cache
    service (``dmaload serve``): the same bytes, as a private copy-on-write
    mapping of the service's memory, without reading the disk when the
    service holds the file. Without a service it loads directly and says
    so once (``RuntimeWarning``); ``progress`` is not called for a file
    the service serves.
    """
    socket = socket_for(cache)
    if socket is not None:
        return load_cached(path, socket, native_kwargs(dict(options)))
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
