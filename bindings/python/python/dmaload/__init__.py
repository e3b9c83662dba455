"""dmaload: load huge files into shareable memory at the speed of the disk.

>>> import dmaload, numpy as np
>>> with dmaload.load("weights.bin") as buf:          # doctest: +SKIP
...     arr = np.frombuffer(buf, dtype=np.uint8)      # zero-copy view
...     print(len(buf), buf.report.gib_per_second)
...     del arr                                       # views must go before close

``dmaload.save(data, path)`` writes any C-contiguous buffer (bytes, a numpy
array, a Buffer) to a file without copying it, replacing the file atomically.

``dmaload.BlockQueue`` streams blocks between two processes through a ring
of shared memory, passing blocks instead of copying them through a pipe.

``dmaload.safetensors`` loads safetensors files (or sharded models) into
NumPy arrays or PyTorch tensors that are views of one buffer per file.
"""

from __future__ import annotations

from . import safetensors
from ._dmaload import BlockQueue, Buffer, DmaBuf, SafetensorError, __version__, evict
from ._load import load, load_dmabuf, load_into, load_range
from ._options import LoadOptions, SaveOptions
from ._report import Fallback, LoadReport, PageCacheResidency, SaveReport
from ._save import save

__all__ = [
    "BlockQueue",
    "Buffer",
    "DmaBuf",
    "Fallback",
    "LoadOptions",
    "LoadReport",
    "PageCacheResidency",
    "SafetensorError",
    "SaveOptions",
    "SaveReport",
    "__version__",
    "evict",
    "load",
    "load_dmabuf",
    "load_into",
    "load_range",
    "safetensors",
    "save",
]
