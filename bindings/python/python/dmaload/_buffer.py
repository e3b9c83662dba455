"""Python-side helpers of the native Buffer type."""

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
