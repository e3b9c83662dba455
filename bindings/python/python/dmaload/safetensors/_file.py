"""One loaded safetensors file as NumPy arrays or PyTorch tensors (views of
its buffer, or slices of its data on a device) and the dtype tables: what
the loaders of this package (``__init__``, ``_collective``, ``_device``)
and the serving engines' mapped views share, in a module that imports
none of them. The check that a model's shards hold each tensor once is
the core's (``_dmaload.tensor_index``)."""

from __future__ import annotations

from typing import Any

from .._dmaload import Buffer
from .._header import Header, TensorInfo
from .._report import LoadReport


class _File:
    """One loaded file and its tensor table: either a host buffer (with a
    memoryview of it) or, for a device load, one uint8 tensor holding the
    file's data section on the device."""

    def __init__(
        self,
        buffer: Buffer | None,
        header: Header,
        *,
        device_data: Any = None,
        report: LoadReport | None = None,
        path: str = "",
        data_offset: int = 0,
    ) -> None:
        self.buffer = buffer
        self.view = memoryview(buffer) if buffer is not None else None
        self.metadata = header.metadata
        self.data_start = header.data_start
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in header.tensors}
        # A device load's tensor holds the data section from its byte
        # data_offset (a window of a collective load starts before its first
        # tensor: a negative offset).
        self._torch_base: Any = device_data
        self._base_offset = header.data_start if device_data is None else -data_offset
        self.report = report if report is not None else (buffer.report if buffer is not None else LoadReport())
        self.path = buffer.path if buffer is not None else path

    # NumPy ----------------------------------------------------------------
    def numpy(self, name: str) -> Any:
        import numpy as np

        info = self.tensors[name]
        assert self.view is not None, "NumPy arrays come from host loads"
        np_dtype, raw = _numpy_dtype(info.dtype)
        offset = self.data_start + info.begin
        if raw:
            return np.frombuffer(self.view, dtype=np.uint8, count=info.nbytes, offset=offset)
        count = _product(info.shape)
        if count == 0:
            return np.empty(info.shape, dtype=np_dtype)
        return np.frombuffer(self.view, dtype=np_dtype, count=count, offset=offset).reshape(info.shape)

    # PyTorch --------------------------------------------------------------
    def torch(self, name: str) -> Any:
        import torch

        info = self.tensors[name]
        begin, end = info.begin, info.end
        t_dtype, t_shape = _torch_dtype(torch, info.dtype, info.shape)
        if end == begin:
            device = self._torch_base.device if self._torch_base is not None else "cpu"
            return torch.empty(t_shape if t_dtype is not None else (0,), dtype=t_dtype or torch.uint8, device=device)
        if self._torch_base is None:
            # One uint8 tensor over the whole file. torch.frombuffer keeps a
            # reference to the memoryview, which holds an export of the
            # buffer: the buffer cannot be closed while any tensor lives.
            assert self.view is not None
            self._torch_base = torch.frombuffer(self.view, dtype=torch.uint8)
        raw = self._torch_base[self._base_offset + begin : self._base_offset + end]
        if t_dtype is None:
            return raw
        itemsize = t_dtype.itemsize
        if (self._base_offset + begin) % itemsize != 0:
            raw = raw.clone()  # torch requires aligned storage for wider types
        return raw.view(t_dtype).view(t_shape)

    def tensor(self, name: str, framework: str) -> Any:
        return self.torch(name) if framework == "pt" else self.numpy(name)


def _product(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_NUMPY_NATIVE = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "C64": "complex64",
}
_ML_DTYPES = {
    "BF16": ("bfloat16", "uint16"),
    "F8_E4M3": ("float8_e4m3fn", "uint8"),
    "F8_E5M2": ("float8_e5m2", "uint8"),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", "uint8"),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", "uint8"),
    "F8_E8M0": ("float8_e8m0fnu", "uint8"),
}


def _numpy_dtype(dtype: str) -> tuple[Any, bool]:
    """(NumPy dtype, whether the tensor is returned as 1-D raw bytes)."""
    import numpy as np

    if dtype in _NUMPY_NATIVE:
        return np.dtype(_NUMPY_NATIVE[dtype]).newbyteorder("<"), False
    if dtype in _ML_DTYPES:
        name, fallback = _ML_DTYPES[dtype]
        try:
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, name)), False
        except (ImportError, AttributeError):
            return np.dtype(fallback).newbyteorder("<"), False
    return np.dtype(np.uint8), True


# torch names every NumPy-native type alike and has the ml_dtypes types built in.
_TORCH = {**_NUMPY_NATIVE, **{dtype: name for dtype, (name, _) in _ML_DTYPES.items()}}


def _torch_dtype(torch: Any, dtype: str, shape: tuple[int, ...]) -> tuple[Any, tuple[int, ...]]:
    """(torch dtype, shape of the returned tensor); dtype None means the raw
    bytes as a 1-D uint8 tensor."""
    if dtype == "F4":
        if shape and shape[-1] % 2 == 0 and hasattr(torch, "float4_e2m1fn_x2"):
            return torch.float4_e2m1fn_x2, (*shape[:-1], shape[-1] // 2)
        return None, (-1,)
    name = _TORCH.get(dtype)
    t = getattr(torch, name, None) if name else None
    if t is not None:
        return t, shape
    if dtype.startswith("F8"):
        return torch.uint8, shape  # the raw bits, same shape
    return None, (-1,)  # F6, or U16/U32/U64 before torch 2.3
