"""``cache=``: get whole files from the model-cache service (``dmaload serve``).

The service keeps loaded files in sealed memfds; a client sends it an open
file descriptor (never a path) and receives the file's bytes as a private
copy-on-write mapping of the service's memory: the same :class:`Buffer` a
direct load returns, in milliseconds, and writes to it stay in this
process. Without a service the file is loaded directly and the reason is
said once (a ``RuntimeWarning``); so it is when the service does not
acknowledge the request within 3 s, goes silent for 5 s (stopped, or
stuck), or its loads read nothing for 15 s. Ctrl-C interrupts the connect
and every wait for the service (``KeyboardInterrupt``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, TypeAlias, Union

from . import _dmaload
from ._dmaload import Buffer
from ._report import LoadReport

Cache: TypeAlias = Union[bool, str, "os.PathLike[str]", None]
"""``True`` (the default socket, or the one ``DMALOAD_CACHE`` names), a
socket path, ``False`` (never), or ``None`` (what ``DMALOAD_CACHE`` says:
``1`` for the default socket, a socket path, or unset/``0`` for none)."""

CACHE_ENV = "DMALOAD_CACHE"

_said: set[str] = set()


def socket_for(cache: Cache) -> str | None:
    """The socket ``cache`` names, or None for a direct load."""
    env = os.environ.get(CACHE_ENV, "")
    if cache is None:
        if env in ("", "0"):
            return None
        cache = True
    if isinstance(cache, bool):
        if not cache:
            return None
        return env if env not in ("", "0", "1") else os.fspath(_dmaload.default_cache_socket())
    if isinstance(cache, (str, bytes, os.PathLike)):
        return os.fsdecode(cache)
    raise TypeError(f"cache= takes True, False, None or a socket path, not {type(cache).__name__}")


def _say_once(message: str) -> None:
    # The message without its details: one warning per kind of reason.
    key = message.split(":", 1)[0]
    if key not in _said:
        _said.add(key)
        warnings.warn(f"dmaload: {message}", RuntimeWarning, stacklevel=4)


def load_cached(file: Any, socket: str, options: dict[str, Any]) -> Buffer:
    """The whole ``file`` (a path or a descriptor) from the service at
    ``socket``, else a direct load of it with ``options`` (the reason said
    once)."""
    buffer, served, message = _dmaload.load_cached(file, socket, options=options)
    _say(served, message, "loaded directly")
    assert buffer is not None, "load_cached falls back to a direct load"
    return buffer


def from_service(file: Any, socket: str, options: dict[str, Any]) -> Buffer | None:
    """The whole ``file`` (a path or a descriptor) from the service at
    ``socket``, or None where the service cannot serve it (the reason said
    once): for callers that read the file themselves rather than load it
    into host memory."""
    buffer, served, message = _dmaload.load_cached(file, socket, options=options, fallback=False)
    _say(served, message, "read from the file")
    return buffer


def say_fallback(report: LoadReport, instead: str) -> None:
    """Says once why the service did not serve a load whose report lists
    it among its ``fallbacks`` (``cache-service -> ...``)."""
    for fallback in report.fallbacks:
        if fallback.from_ == "cache-service":
            _say_once(f"{fallback.reason}; {instead}")


def _say(served: str | None, message: str | None, instead: str) -> None:
    if served is None and message is not None:
        _say_once(f"{message}; {instead}")
    elif message is not None:
        _say_once(f"cache service: {message}")
