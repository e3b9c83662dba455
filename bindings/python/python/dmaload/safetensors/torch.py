"""``safetensors.torch``-compatible entry points: swap the import, keep the code."""

from __future__ import annotations

import os
from typing import Any, Union, Unpack

from .._options import LoadOptions, Size
from .._progress import Progress
from . import DEFAULT_CONCURRENCY, Backend, TensorFilter
from . import load_file as _load_file

__all__ = ["load_file"]


def load_file(
    filename: Union[str, "os.PathLike[str]"],
    device: Any = "cpu",
    *,
    progress: Progress = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    process_group: Any = None,
    tensor_filter: TensorFilter = None,
    window: Size | None = None,
    backend: Backend = None,
    **options: Unpack[LoadOptions],
) -> dict[str, Any]:
    """Like ``safetensors.torch.load_file``: a dict of PyTorch tensors, each a
    view of the loaded file on the CPU (copied to ``device`` otherwise).
    ``process_group``, ``tensor_filter``, ``window`` and ``backend``: see
    :func:`dmaload.safetensors.load_file`."""
    return _load_file(
        filename,
        device,
        "pt",
        progress=progress,
        concurrency=concurrency,
        process_group=process_group,
        tensor_filter=tensor_filter,
        window=window,
        backend=backend,
        **options,
    )
