"""Python-side helpers of the native Buffer type, and of the memoryviews
the native calls are given."""

from __future__ import annotations

from typing import Any


def dlpack(
    buffer: Any,
    stream: Any = None,
    max_version: Any = None,
    dl_device: Any = None,
    copy: Any = None,
) -> Any:
    """DLPack capsule for a Buffer: a 1-D uint8 CPU tensor over its bytes.

    The capsule is produced by NumPy over a memoryview of the buffer, so it
    holds an export: the buffer cannot be closed while the consumer's tensor
    lives. Needs NumPy >= 1.22.
    """
    try:
        import numpy as np
    except ImportError as exc:  # pragma: no cover - numpy is a test dependency
        raise BufferError("Buffer.__dlpack__ needs numpy (pip install numpy)") from exc
    array = np.frombuffer(memoryview(buffer), dtype=np.uint8)
    kwargs = {
        k: v
        for k, v in (("stream", stream), ("max_version", max_version), ("dl_device", dl_device), ("copy", copy))
        if v is not None
    }
    return array.__dlpack__(**kwargs)


def release_views(*views: memoryview) -> None:
    """Releases ``views`` in order. A view whose export a native call still
    holds is left to the garbage collector: after Ctrl-C, a load or save
    whose read or write a silent FUSE or NFS server holds keeps its export
    until that request ends (the call raised ``KeyboardInterrupt`` without
    waiting), and ``BufferError`` must not replace that exception."""
    for view in views:
        try:
            view.release()
        except BufferError:
            pass
