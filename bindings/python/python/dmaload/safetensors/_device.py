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

With ``cache=`` (a socket) and a CUDA device, the model-cache service
fills the device memory itself: PyTorch allocates one uint8 tensor per
file for the whole file (its header's bytes, up to 255 bytes of padding
that put the data section on a 256-byte boundary, then the data: a few KiB
more than the data alone), this process sends the service a CUDA IPC
handle of the allocation that tensor lies in and the tensor's offset in it
(the native ``_load_staged(..., socket=)``), and the service copies the
file from its own pinned copy (pinned once per cached file, not per load)
on its own streams. This process reads, pins and copies nothing. Where the
service cannot (none answers, another user, a service that does not see
this device, the driver refuses the handle: MIG, a container without the
device; PyTorch's ``expandable_segments:True``, whose memory has no CUDA
IPC handle) the file takes the staged path from the disk, the reason is said
once (a ``RuntimeWarning``) and the file's report lists it in
``fallbacks`` (``cache-service -> staged``). With ``cache=`` and
``device="cpu"``, the service's sealed memfd of the file is the source the
staged path reads.

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
from .._cache import from_service, say_fallback
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
    import torch

    native = native_options(options)
    if socket is not None and _ordinal(torch, device) >= 0:
        # The service copies each file into the device memory itself.
        files = [_dmaload.open_safetensors(os.fspath(p)) for p in paths]
        return load_opened(files, device, progress, options, socket)
    return load_opened([_open(p, socket, native) for p in paths], device, progress, options)


def load_opened(
    files: list[_dmaload.SafetensorsFile],
    device: Any,
    progress: Progress,
    options: dict[str, Any],
    socket: str | None = None,
) -> list[_File]:
    """:func:`load_files` of files (or objects) opened already, their
    headers read: the data come from those same opens (an object's GETs
    pin the ETag its open found), or from the cache service at ``socket``
    (CUDA devices only), which copies each whole file into the device."""
    import torch

    ordinal = _ordinal(torch, device)
    target = torch.device("cpu") if ordinal < 0 else torch.device("cuda", ordinal)
    native = native_options(options)
    paths = [os.fsdecode(f.path) for f in files]
    if socket is not None and ordinal < 0:
        raise ValueError("the cache service fills device memory only: a host load takes its memfd (load_files)")
    # With the service, room for each file's header before its data, and
    # padding that puts the data on a 256-byte boundary of the allocation.
    leads = [(-f.data_start) % 256 + f.data_start if socket is not None else 0 for f in files]
    need = sum(lead + f.data_len for lead, f in zip(leads, files))
    if ordinal >= 0:
        # The core's check, as its own device loads make it: before PyTorch
        # allocates anything.
        load = paths[0] if len(paths) == 1 else f"{len(paths)} files from {paths[0]}"
        _dmaload.check_device_memory(ordinal, need, load)
    whole = [torch.empty(lead + f.data_len, dtype=torch.uint8, device=target) for lead, f in zip(leads, files)]
    data = [w[lead:] for lead, w in zip(leads, whole)]
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
        reports = _dmaload._load_staged(
            files, targets, ordinal, options=native, progress=callback, keep=whole, socket=socket
        )
    finally:
        finish()
    for report in reports:
        say_fallback(report, "read from the file")
    return [
        _File(None, f.header, device_data=d, report=r, path=os.fsdecode(f.path))
        for f, d, r in zip(files, data, reports)
    ]
