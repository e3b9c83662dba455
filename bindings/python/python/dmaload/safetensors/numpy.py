"""``safetensors.numpy``-compatible entry points: swap the import, keep the code."""

from __future__ import annotations

import os
from typing import Any, Union, Unpack

from .._options import LoadOptions
from .._progress import Progress
from . import DEFAULT_CONCURRENCY, Backend
from . import load_file as _load_file

__all__ = ["load_file"]


def load_file(
    filename: Union[str, "os.PathLike[str]"],
    *,
    progress: Progress = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    backend: Backend = None,
    **options: Unpack[LoadOptions],
) -> dict[str, Any]:
    """Like ``safetensors.numpy.load_file``: a dict of NumPy arrays, each a
    view of the loaded file (see ``dmaload.safetensors``; ``backend``: see
    :func:`dmaload.safetensors.load_file`)."""
    return _load_file(filename, "cpu", "np", progress=progress, concurrency=concurrency, backend=backend, **options)
