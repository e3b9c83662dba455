"""A safetensors header, as dataclasses (built field by field by the native
module: ``read_safetensors_header``, ``parse_safetensors_header``,
``load_safetensors`` and ``SafetensorsFile.header`` return a :class:`Header`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Header", "TensorInfo"]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a header. ``begin`` and ``end`` are byte offsets relative
    to the data section (add ``Header.data_start`` for offsets in the file).

    Earlier versions gave a tuple ``(name, dtype, shape, begin, end)``;
    unpacking still works (``name, dtype, shape, begin, end = info``: the
    record iterates over its five fields in that order), but indexing
    (``info[3]``) and comparison with a tuple do not.
    """

    name: str
    dtype: str
    """The safetensors dtype name: ``"F32"``, ``"BF16"``, ``"F8_E4M3"``, ..."""
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of data: ``end - begin``."""
        return self.end - self.begin

    def __iter__(self) -> Iterator[Any]:
        """The fields in the order of the old tuple, for unpacking."""
        return iter((self.name, self.dtype, self.shape, self.begin, self.end))


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed and validated safetensors header."""

    tensors: tuple[TensorInfo, ...]
    """The tensors in the order of their data in the file."""
    metadata: dict[str, str] | None
    """The ``__metadata__`` entry, or None when the file has none."""
    data_start: int
    """Offset in the file of the data section: 8 + the JSON's length."""

    @property
    def data_len(self) -> int:
        """Bytes of the data section (the end of the last tensor)."""
        return self.tensors[-1].end if self.tensors else 0
