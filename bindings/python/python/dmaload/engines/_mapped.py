"""A warm checkpoint's tensors as views of the page cache, each file
mapped under its read lease (:class:`dmaload._dmaload.LeasedFile`; the
design and its limits: docs/guarantees.md, "Mapped views of a warm file").

An engine copies each tensor into its parameter before it asks for the
next one, so a view of the page cache costs one copy, as the engine's own
loader does, where the windowed read costs two. A writer of a mapped file
(an open for writing, a truncate) waits until the mapping holds a private
copy of the bytes, so a view never faults and always shows one version."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .. import _dmaload
from .._header import Header
from ..safetensors._collective import wants
from ..safetensors._file import _File

Progress = Callable[[int, int], None] | None


class Mapped:
    """The files of one load, each mapped under its read lease; iterating
    gives ``(name, tensor)`` for each wanted tensor in file and data order,
    CPU tensors over the mappings. Each file's mapping is dropped by this
    object once its tensors are handed out: its lease goes when the engine
    has dropped them too."""

    def __init__(self, paths: list[Path], leased: list[Any], tensor_filter: Any) -> None:
        self.paths = paths
        self._leased: list[Any] = leased
        self._wants = wants(tensor_filter)
        self._total = sum(len(f) for f in leased)
        self.progress: Progress = None
        """Counts the bytes of the tensors handed out (may be set until the
        iteration begins)."""

    @classmethod
    def open(cls, files: Sequence[str], device: Any, tensor_filter: Any, *, plain: bool) -> Mapped | str:
        """The files mapped, or why not (the caller then reads them). Only
        for a CPU load of this process alone with no option of dmaload's
        given (``plain``): a GPU load, a collective one or a load with
        options reads the files."""
        if str(device) != "cpu":
            return f"the tensors go to {device}, not the CPU"
        if not plain:
            return "options, a collective read or the model-cache service were asked for"
        leased = []
        for f in files:
            try:
                leased.append(_dmaload.LeasedFile(f))
            except OSError as exc:
                return f"{f}: {exc.strerror}"
        return cls([Path(f) for f in files], leased, tensor_filter)

    def reads(self) -> str:
        return f"0.000 GiB of the checkpoint ({self._total / 2**30:.3f} GiB mapped from the page cache under read leases)"

    def close(self) -> None:
        self._leased.clear()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        import torch

        headers = [_header(f) for f in self._leased]
        _dmaload.tensor_index([(os.fspath(p), [t.name for t in h.tensors]) for p, h in zip(self.paths, headers)], None)
        total = sum(t.nbytes for h in headers for t in h.tensors if self._wants(t.name))
        done = 0
        try:
            for header in headers:
                leased = self._leased.pop(0)
                data = torch.frombuffer(leased, dtype=torch.uint8) if len(leased) else None
                view = _File(None, header, device_data=data, data_offset=-header.data_start)
                del leased, data  # the tensors keep the mapping alive, nothing else
                for t in sorted(header.tensors, key=lambda t: t.begin):
                    if self._wants(t.name):
                        yield t.name, view.torch(t.name)
                        done += t.nbytes
                        if self.progress is not None:
                            self.progress(done, total)
                del view
        finally:
            self.close()


def _header(leased: Any) -> Header:
    """The header of a mapped file, read from the mapping (the file at the
    path may be another by now; the mapped one cannot change under us)."""
    view = memoryview(leased)
    try:
        n = int.from_bytes(view[:8], "little") if len(view) >= 8 else 0
        return _dmaload.parse_safetensors_header(bytes(view[: 8 + min(n, len(view) - 8)]), len(view))
    finally:
        view.release()
