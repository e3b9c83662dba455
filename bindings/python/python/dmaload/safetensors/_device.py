"""safetensors files straight into device memory.

``load_file(path, device="cuda:N")`` comes here: each file is opened once
and its header validated, PyTorch allocates one uint8 tensor per file for
its data section on the device (so PyTorch owns and frees that memory, and
every tensor is a view of it), and the native loader reads the file with
direct I/O into a small pinned staging ring (32 × 16 MiB by default),
copying each filled slot to the device with asynchronous copies while the
next slots fill. Host memory used: the ring and the headers, whatever the
model size. A failed load raises and returns no tensors (the allocations
are freed with the exception).

With ``cache=`` (a socket), each file comes from the model-cache service
instead of the disk: the service's sealed memfd of the file is the source
the same staged path reads (copies from memory into the pinned ring, then
to the device), so a model another process loaded reaches this device
without a disk read.

An object (``s3://BUCKET/KEY``, a shard of a model in object storage) is
opened the same way (``open_safetensors`` looks it up and reads its header
with a ranged GET), and its data section is received by the GETs into the
ring's slots, the core's device path for objects (docs/object-storage.md).

``device="cpu"`` is accepted here too (the same staged path into a host
tensor): the tests run every part of this code without a GPU that way.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import _dmaload
from .._cache import from_service
from .._options import native_options
from .._progress import Progress, resolve
from ._file import _File

__all__ = ["is_device", "load_files", "load_opened"]


def is_device(device: Any) -> bool:
    """Whether ``device`` names something other than the CPU."""
    return str(device) != "cpu"


def _ordinal(torch: Any, device: Any) -> int:
    """The CUDA device index of ``device``, or -1 for the CPU."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise type(err)(f"device={device!r} is not a device PyTorch knows: {err}") from err
    if dev.type == "cpu":
        return -1
    if dev.type != "cuda":
        raise ValueError(f"dmaload loads to 'cpu' or 'cuda:N' devices, not {str(device)!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {str(device)!r} asked for, but PyTorch sees no CUDA device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"device cuda:{index} asked for, but there are {torch.cuda.device_count()} CUDA device(s)")
    return int(index)


def _open(path: str | Path, socket: str | None, native: dict[str, Any]) -> _dmaload.SafetensorsFile:
    """``path`` opened for the staged load: the cache service's memfd of it
    where ``socket`` names a service that has or loads the file, else the
    file itself (``from_service`` says once why)."""
    if socket is None:
        return _dmaload.open_safetensors(os.fspath(path))
    # One open of the path: the service gets a descriptor of this file, and
    # without the service this same file is read. (Non-blocking: a FIFO is
    # refused by type instead of waiting for a writer.)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        buffer = from_service(fd, socket, native)
        if buffer is None:
            return _dmaload.open_safetensors(fd, None, os.fspath(path))
    finally:
        os.close(fd)
    try:
        # The service's memfd holds the file from offset 0, in whole pages;
        # the opened file keeps its own reference when the mapping goes.
        if buffer.memfd_offset != 0:
            raise OSError(errno.EIO, "cache service: the memfd it sent does not start at the file", os.fspath(path))
        return _dmaload.open_safetensors(buffer.fileno(), len(buffer), os.fspath(path))
    finally:
        buffer.close()


def load_files(
    paths: Sequence[str | Path],
    device: Any,
    progress: Progress,
    options: dict[str, Any],
    socket: str | None = None,
) -> list[_File]:
    """Loads every tensor of ``paths`` (files, or object URLs as strings:
    ``Path`` would fold ``s3://``'s slashes) onto ``device``, from the cache
    service at ``socket`` when given; one ``_File`` per path."""
    native = native_options(options)
    return load_opened([_open(p, socket, native) for p in paths], device, progress, options)


def load_opened(
    files: list[_dmaload.SafetensorsFile], device: Any, progress: Progress, options: dict[str, Any]
) -> list[_File]:
    """:func:`load_files` of files (or objects) opened already, their
    headers read: the data come from those same opens (an object's GETs
    pin the ETag its open found)."""
    import torch

    ordinal = _ordinal(torch, device)
    target = torch.device("cpu") if ordinal < 0 else torch.device("cuda", ordinal)
    native = native_options(options)
    paths = [os.fsdecode(f.path) for f in files]
    need = sum(f.data_len for f in files)
    if ordinal >= 0:
        free, _total = torch.cuda.mem_get_info(ordinal)
        if need > free:
            raise OSError(
                errno.ENOMEM,
                f"load: {len(files)} file(s) need {need} bytes on cuda:{ordinal} but only {free} are free",
                paths[0],
            )
    data = [torch.empty(f.data_len, dtype=torch.uint8, device=target) for f in files]
    if ordinal >= 0:
        # The caching allocator may hand out memory that kernels queued on
        # the current stream still use: they finish before our copies start.
        torch.cuda.current_stream(target).synchronize()
    desc = os.path.basename(paths[0]) if len(paths) == 1 else f"{len(paths)} files"
    callback, finish = resolve(progress, desc)
    try:
        # Device memory goes as pointers, its tensors as `keep` (held by the
        # load, even one Ctrl-C leaves to its thread, until it ends); host
        # memory as writable buffer exports.
        targets = [d.data_ptr() for d in data] if ordinal >= 0 else [d.numpy() for d in data]
        reports = _dmaload._load_staged(files, targets, ordinal, options=native, progress=callback, keep=data)
    finally:
        finish()
    return [
        _File(None, f.header, device_data=d, report=r, path=os.fsdecode(f.path))
        for f, d, r in zip(files, data, reports)
    ]
