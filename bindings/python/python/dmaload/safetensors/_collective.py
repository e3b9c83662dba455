"""Loads shared by the ranks of a ``torch.distributed`` group, and filtered loads.

``iter_tensors(path, process_group=group)`` (and ``load_file``/``safe_open``
with ``process_group=``; this module's :class:`Stream` does the work) reads
each byte of the checkpoint once across the group instead of once per rank:

1. Every rank opens each file once (the same open files serve every
   window: a write to a file after that fails the load, as it fails a
   one-file load) and reads its header (a few KiB). One ``all_gather``
   then checks that all ranks see the same files and headers and pass
   the same ``window``, and whether they can show they read the same
   bytes: the same files on one host (boot id, device, inode, size,
   modification and change times), else the digests their sums files
   record, agreed in a second ``all_gather`` and checked over the whole
   stream each rank is handed (see :func:`_same_bytes`); otherwise every
   rank refuses, saying how to make the load safe. Then it forms the
   union of the tensors the ranks want (``tensor_filter``): a tensor no
   rank wants is never read (unless the load is verified: every byte is
   then read, to be hashed).
2. The wanted tensors are cut into *windows*: runs of adjacent tensors of
   one file, at most ``window`` bytes (a tensor larger than that is a
   window of its own). A window's byte range, widened at its start to a
   4 KiB boundary of the file, is split into N equal slots of a multiple of
   4 KiB: rank r reads slot r with a range load (on the stream's
   ``_dmaload.WindowLoader``, direct I/O where the file system allows)
   into its part of the window's buffer.
   Equal aligned slots, not cuts at tensor boundaries: every rank's share
   of every window is the same to 4 KiB whatever the tensor sizes, no two
   ranks read the same block, and the slots lie end to end so a tensor that
   straddles two of them is still one view.
3. The ranks exchange their read status (``all_gather`` of an errno), then
   the slots (``all_gather_into_tensor``, in place, on the group's backend:
   gloo in host memory, NCCL in device memory). Every tensor of the window
   is then a view of that buffer (a copy where the window also holds
   tensors this rank did not ask for, so that what it keeps holds no other
   rank's bytes), handed out while a background thread
   reads and exchanges the next window: at most about three windows are held
   beyond what the caller keeps. With ``recycle`` the buffers are a ring of
   ``GROUP_RING``, reused once the consumer is two windows past them.

A read that fails on one rank fails every rank at that window's status
exchange, each raising :class:`CollectiveLoadError` naming the failing rank,
file and byte range. A rank that dies, stops or leaves the load makes the
others' collective fail: at once where the backend notices (gloo, for a
closed connection), else within ``_heartbeat.DEAD_AFTER`` seconds of its last
heartbeat (:class:`_Heartbeat`, through the group's store), not the
group's timeout; raised the same way. Every rank must consume the whole
iterator: the collectives are matched across ranks in order.

Without a group the same plan serves one process, read differently: each
window (``DEFAULT_WINDOW`` unless ``window`` is given) is one load, queued
on a native ``_dmaload.WindowLoader`` as soon as a buffer of the ring is
free: its threads run the loads in order, ``LOADS_IN_FLIGHT`` at a time,
and never take the GIL, and each load's ``Arrival`` says, gather by
gather, that the window's bytes ``0..n`` are in, so its tensors are handed
out as soon as their bytes are. So a filter leaves unread what it
excludes, the first tensors come while the rest of the file is still on
the disk, the read runs up to three windows ahead of the consumer, and the
ring of ``RING`` window buffers, the only host memory the stream faults
in, stays about five windows (and the largest tensor) whatever the shard
size; each new buffer is first admitted by the memory check a load into
fresh memory makes, so where memory is short the stream reads ahead less
(and raises ENOMEM where not even the next window fits), never into the
OOM killer. A failed read raises :class:`CollectiveLoadError` at the next
tensor: nothing after it is handed out. ``Stream.start`` begins the reads
before the iteration (in the same buffers).
"""

from __future__ import annotations

import collections
import errno as errno_codes
import hashlib
import os
import queue
import threading
from collections.abc import Callable, Collection, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, Union

from .. import _dmaload
from .._header import Header, TensorInfo
from .._options import Size, native_options, parse_size
from .._progress import Progress, resolve
from ._file import _File
from ._group import CollectiveLoadError, Source, _collective, _Group
from ._same import _HOST, _identity, _object_identity, _other_objects, _same_bytes

__all__ = ["DEFAULT_WINDOW", "CollectiveLoadError", "Stream", "TensorFilter"]

TensorFilter: TypeAlias = Union[Collection[str], Callable[[str], bool], None]

"""The tensors a rank wants: a collection of names, a predicate on the
name, or None for all."""

DEFAULT_WINDOW = 64 << 20
"""Bytes of tensors read (and exchanged with a group) at a time
(``window=None``); a larger tensor is a window of its own. A window is one
load, so the ring of window buffers stays a few windows of host
memory; 64 MiB windows read as fast as 1 GiB ones on the development VM
(docs/benchmarks.md, "One-rank streams in 64 MiB windows")."""

_ALIGN = 4096
"""Slots start at this multiple of the file offset (direct-I/O alignment)."""


@dataclass(frozen=True)
class _Window:
    """Adjacent tensors of one file, read as one range split into slots."""

    file: int
    tensors: tuple[TensorInfo, ...]
    start: int
    """File offset of the first byte read (a multiple of ``_ALIGN``)."""
    end: int
    """File offset after the last tensor's last byte."""
    slot: int
    """Bytes per rank (a multiple of ``_ALIGN``); the buffer is N slots."""

    def share(self, rank: int) -> tuple[int, int]:
        """The file range rank ``rank`` reads: (offset, length)."""
        offset = self.start + rank * self.slot
        return offset, max(0, min(self.slot, self.end - offset))


def wants(tensor_filter: TensorFilter) -> Callable[[str], bool]:
    """``tensor_filter`` as a predicate on the tensor's name."""
    if tensor_filter is None:
        return lambda _name: True
    if callable(tensor_filter):
        return tensor_filter
    if isinstance(tensor_filter, str):
        raise TypeError("tensor_filter takes a collection of names or a predicate, not one str")
    names = frozenset(tensor_filter)
    return names.__contains__


def _windows(
    headers: list[Header], wanted: list[bool], window: int, ranks: int, sizes: list[int] | None = None
) -> list[_Window]:
    """The windows of the wanted tensors (``wanted`` is indexed like the
    tensors of all headers in order), in file and data order: runs of
    adjacent wanted tensors of a file, of up to ``window`` bytes (split
    between tensors only; a larger tensor is a window of its own).

    With ``sizes`` (the files' sizes: a verified load) every byte of each
    file is in a window, in order: every tensor is read (the unwanted ones
    are not handed out), the first window of a file starts at byte 0 (its
    header) and its last ends at the end of the file, so that the windows
    hash to the file's digest."""
    out: list[_Window] = []
    whole = sizes is not None
    k = 0
    for i, header in enumerate(headers):
        run: list[TensorInfo] = []
        first = len(out)

        def close() -> None:
            if run:
                start = (header.data_start + run[0].begin) // _ALIGN * _ALIGN
                out.append(_window(i, tuple(run), start, header.data_start + run[-1].end, ranks))
                run.clear()

        for t in header.tensors:
            take = wanted[k] or whole
            k += 1
            if t.nbytes == 0:
                continue  # no bytes to read (each rank makes its own), nor a gap in a run
            too_long = run and t.end - run[0].begin > window
            if not take or (run and ((t.begin != run[-1].end and not whole) or too_long)):
                close()
            if take:
                run.append(t)
        close()
        if sizes is not None:
            if len(out) == first:  # no tensor with bytes: the file is its header
                out.append(_window(i, (), 0, sizes[i], ranks))
            out[first] = _window(i, out[first].tensors, 0, out[first].end, ranks)
            out[-1] = _window(i, out[-1].tensors, out[-1].start, sizes[i], ranks)
    return out


def _window(file: int, tensors: tuple[TensorInfo, ...], start: int, end: int, ranks: int) -> _Window:
    """The window of file bytes ``start..end``, cut into ``ranks`` slots."""
    slot = -(-(end - start) // ranks)
    slot = -(-slot // _ALIGN) * _ALIGN
    return _Window(file, tensors, start, end, slot)


def _basename(p: Source) -> str:
    return os.path.basename(os.fspath(p))


def _digest(paths: list[Source], headers: list[Header]) -> int:
    """A fingerprint of the files' names and tables, equal on ranks that see
    the same checkpoint."""
    h = hashlib.blake2b(digest_size=7)
    for p, header in zip(paths, headers):
        h.update(_basename(p).encode() + b"\0")
        for t in header.tensors:
            h.update(f"{t.name}\0{t.dtype}\0{t.shape}\0{t.begin}\0{t.end}\0".encode())
    return int.from_bytes(h.digest(), "little")


_LOADS: dict[str, int] = {}
"""The last load number of each group in this process."""


RING = 5
"""Window buffers that ``recycle`` reuses without a group: the one before
the window being handed out, that one, and three more being read or
waiting, so the read runs up to three windows ahead of the consumer and a
slow stretch of the disk, or a large tensor, does not stall it (3 buffers,
one window ahead, waited 0.1-0.3 s longer for a 1.17 GiB model beside an
engine's work: docs/benchmarks.md)."""

GROUP_RING = 3
"""Window buffers that ``recycle`` reuses with a group (device memory under
NCCL): the one before the window being handed out, that one, and the next
(being read and exchanged, then waiting)."""

LOADS_IN_FLIGHT = 2
"""Window loads a stream runs at once: the next window's load starts while
the last reads of this one are still on the disk, so the disk does not
wait for a load's set-up."""


class _Stopped(Exception):
    """The consumer left: the reader thread stops."""


class _Buffers:
    """Where windows are read: new memory for each, or with ``recycle`` a
    ring of ``depth`` buffers of the largest window's size (pages a smaller
    window leaves untouched are never faulted in), reused once the consumer
    is two windows past them, so each page is touched once, not once per
    window. ``admit(file, n)``, where given, raises OSError (ENOMEM)
    unless ``n`` bytes of memory are available: it is asked before each
    allocation (see :meth:`take`)."""

    def __init__(
        self,
        recycle: bool,
        make: Callable[[int], Any],
        largest: int,
        depth: int,
        admit: Callable[[int, int], None] | None,
    ) -> None:
        self._recycle, self._make, self._largest, self._depth = recycle, make, largest, depth
        self._admit = admit
        self._free: queue.Queue[Any] = queue.Queue()
        self._made = 0

    def take(self, n: int, file: int, unfaulted: int = 0) -> tuple[Any, Any]:
        """(the buffer to give back, a view of its first ``n`` bytes). A
        new buffer is admitted first, counting the ``unfaulted`` bytes of
        buffers already taken whose pages are still being faulted in (the
        memory check sees only what is charged): OSError (ENOMEM), as a
        load into fresh memory gives, rather than the OOM killer."""
        if not self._recycle or self._made < self._depth:
            size = self._largest if self._recycle else n
            if self._admit is not None:
                self._admit(file, size + unfaulted)
            base = self._make(size)
            self._made += self._recycle
        else:
            base = self._free.get()
            if base is None:
                raise _Stopped
        return base, base[:n]

    def try_take(self, n: int, file: int, unfaulted: int) -> tuple[Any, Any] | None:
        """``take``, or None where it would wait for a buffer."""
        if self._recycle and self._made >= self._depth and self._free.empty():
            return None
        return self.take(n, file, unfaulted)

    def give(self, base: Any) -> None:
        if self._recycle:
            self._free.put(base)

    def wake(self) -> None:
        """Unblocks a ``take`` waiting for a buffer (it raises ``_Stopped``)."""
        self._free.put(None)


def _aligned_empty(torch: Any, n: int, device: Any) -> Any:
    """``n`` uninitialised bytes, page-aligned on the host (direct I/O reads
    straight into them)."""
    if device.type != "cpu":
        return torch.empty(n, dtype=torch.uint8, device=device)
    raw = torch.empty(n + _ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % _ALIGN
    return raw[skip : skip + n]


class Stream:
    """A load of ``paths`` by this rank (and the other ranks of
    ``process_group``): opening it opens each file once, reads the headers
    and agrees on the plan with the group; iterating it gives ``(name,
    tensor)`` for each tensor this rank wants, in file and data order,
    PyTorch tensors on ``device``; see the module doc. ``progress`` counts
    the bytes of the tensors handed out here. ``close()`` (or the end of the
    iteration, or leaving a ``with`` block) closes the files."""

    def __init__(
        self,
        paths: list[Source],
        weight_map: dict[str, str] | None = None,
        device: Any = "cpu",
        *,
        process_group: Any = None,
        tensor_filter: TensorFilter = None,
        window: Size | None = None,
        progress: Progress = None,
        recycle: bool = False,
        options: dict[str, Any] | None = None,
    ) -> None:
        import torch

        native = native_options(options or {})
        # Verified here, window by window (see _Verify): each window's load
        # is a part of the file, which the core does not verify.
        self._verify = bool(native.pop("verify", False))
        self._native = native
        self._group = _Group(process_group) if process_group is not None else None
        self._window = DEFAULT_WINDOW if window is None else parse_size(window)
        if self._window < 1:
            raise ValueError(f"window must be at least 1 byte, not {window!r}")
        self._wants = wants(tensor_filter)
        self._target = torch.device(device if device is not None else "cpu")
        if self._group is not None and self._group.device.type != "cpu" and self._target != self._group.device:
            raise ValueError(f"device={device!r}: this NCCL group exchanges on {self._group.device}: load there")
        self.progress = progress
        """Counts the bytes of the tensors handed out (may be set until the
        iteration begins)."""
        # Without a group a window is read into host memory and each tensor
        # goes on to the device as it is handed out.
        device_of_buffers = self._group.device if self._group else torch.device("cpu")
        self._host_buffers = device_of_buffers.type == "cpu"
        self._recycle = recycle
        self._make_buffer: Callable[[int], Any] = lambda n: _aligned_empty(torch, n, device_of_buffers)
        self.paths = paths
        # Objects (every source an s3:// URL) are looked up once by the
        # loader, each GET pinned to the ETag seen then; files are opened here.
        self._objects = bool(paths) and all(isinstance(p, str) and p.startswith("s3://") for p in paths)
        self._ahead: _StreamAhead | None = None
        self._loader: Any = None
        self._verifier: _Verify | None = None
        self._finished = False
        self._fds: list[int] = []
        self.headers: list[Header] = []
        failure: BaseException | None = None
        try:
            if self._objects:
                self._loader = _dmaload.WindowLoader(paths, options=self._native, in_flight=LOADS_IN_FLIGHT)
                self.headers = [self._loader.header(i) for i in range(len(paths))]
            else:
                for p in paths:
                    # Non-blocking: a FIFO is refused by type, not waited on.
                    self._fds.append(os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK))
                # Every window of this load, and the early read, is a load of
                # these open files: a write to one after this (a same-size
                # rewrite between two windows included) fails the load at the
                # next window's end check, as a one-file load fails.
                self._loader = _dmaload.WindowLoader(self._fds, options=self._native, in_flight=LOADS_IN_FLIGHT)
                self.headers = [_dmaload.open_safetensors(fd, None, os.fspath(p)).header for fd, p in zip(self._fds, paths)]
            _dmaload.tensor_index(
                [(os.fspath(p), [t.name for t in h.tensors]) for p, h in zip(paths, self.headers)], weight_map
            )
        except (OSError, ValueError) as exc:  # ValueError: SafetensorError
            failure = exc
        try:
            self._plan(failure)
        except BaseException:
            self.close()
            raise

    def _plan(self, failure: BaseException | None) -> None:
        """The windows, agreed with the group: every rank learns whether any
        rank failed to open the files (``failure``, raised on every rank),
        sees other headers or passed another window, then whether the ranks
        can show they read the same bytes (see :func:`_same_bytes`), then
        the union of the tensors they want."""
        group = self._group
        if group is None:
            if failure is not None:
                raise failure
            if self._verify:
                self._verifier = _Verify(self.paths, [self._digest_of(i) for i in range(len(self.paths))], self._sizes())
            self._make_windows([bool(self._wants(t.name)) for h in self.headers for t in h.tensors], 1, RING)
            return
        where = f"{len(self.paths)} file(s), the first {self.paths[0] if self.paths else '-'}"
        doing = f"agreeing on the plan of {where}"
        mine_wanted: list[int] = []
        if failure is None:
            # Before the first exchange: a filter that raises on one rank
            # fails every rank there, not one rank between two exchanges.
            try:
                mine_wanted = [int(self._wants(t.name)) for h in self.headers for t in h.tensors]
            except Exception as exc:
                failure = exc
        digest = -1 if failure is not None else _digest(self.paths, self.headers)
        identities: list[str | None] = []
        if failure is not None:
            identity = 0
        elif self._objects:
            identities = [self._loader.object_identity(i) for i in range(len(self.paths))]
            identity = _object_identity(identities)
        else:
            identity = _identity(self._fds)
        # The load's number in the group, for the heartbeat's keys: the
        # next one after every rank's last (a rank may have failed a load
        # before its first collective).
        load = _LOADS.get(group.name, 0) + 1
        # Ranks on any hosts read the same bytes of an object version.
        host = 0 if self._objects else _HOST
        mine = [digest, self._window, int(self._verify), load, host, identity]
        rows = _collective(group, doing, group.gather_ints, mine)
        for r, (theirs, window, *_rest) in enumerate(rows):
            if theirs == -1:
                cause = f": {failure}" if r == group.rank else ""
                raise CollectiveLoadError(
                    f"rank {group.rank}: rank {r} could not open or read the headers of {where}, "
                    f"or apply its tensor_filter{cause}"
                ) from failure
            if theirs != rows[0][0]:
                raise CollectiveLoadError(f"rank {group.rank}: rank {r} sees other files or headers than rank 0 ({where})")
            if window != rows[0][1]:
                raise CollectiveLoadError(
                    f"rank {group.rank}: rank {r} passed window={window}, rank 0 window={rows[0][1]} ({where}): "
                    "every rank of a group load must pass the same window (it sets the size of each exchange)"
                )
        _LOADS[group.name] = max(row[3] for row in rows)
        group.watch(_LOADS[group.name])
        # One rank asking for verification makes every rank verify: the
        # digests are agreed and checked collectively.
        self._verify = any(row[2] for row in rows)
        same_file = all(row[4:] == rows[0][4:] for row in rows)
        if self._objects and not same_file:
            raise _other_objects(group, where, self.paths, identities)
        if self._verify or not same_file:
            digests = _same_bytes(group, where, self.paths, self._digest_of, same_file)
            self._verifier = _Verify(self.paths, digests, self._sizes())
        everyone = _collective(group, doing, group.gather_ints, mine_wanted) if mine_wanted else []
        self._make_windows([any(row[k] for row in everyone) for k in range(len(mine_wanted))], group.size, GROUP_RING)

    def _digest_of(self, i: int) -> Any:
        """The native digest of source ``i`` to come (``_dmaload.StreamDigest``),
        its expected value from the sums file beside it (an object's: the sums
        object beside it, read with the loader's settings); OSError (EINVAL)
        saying so when none lists it."""
        return self._loader.digest(i) if self._objects else _dmaload.StreamDigest(Path(self.paths[i]))

    def _sizes(self) -> list[int]:
        """Each source's size as the loader opened it."""
        if self._objects:
            return [self._loader.size(i) for i in range(len(self.paths))]
        return [os.fstat(fd).st_size for fd in self._fds]

    def _make_windows(self, wanted: list[bool], ranks: int, depth: int) -> None:
        sizes = self._verifier.sizes if self._verifier is not None else None
        self.windows = _windows(self.headers, wanted, self._window, ranks, sizes)
        largest = max((ranks * w.slot for w in self.windows), default=0)
        # Device memory (NCCL) is not the host's to check: its allocation
        # fails cleanly by itself.
        admit = self._loader.check_memory if self._host_buffers else None
        self._buffers = _Buffers(self._recycle, self._make_buffer, largest, depth, admit)

    def start(self) -> _StreamAhead:
        """Starts reading now, before the iteration asks for a tensor (a
        load without a group only; the iteration then takes over what has
        arrived): the loader's threads load the first windows, as many as
        the ring holds and the memory check admits, into the buffers the
        iteration will use, so memory stays bounded as in the iteration.
        ``close()`` stops them."""
        if self._group is not None:
            raise ValueError("a load shared by a group starts with its iteration")
        if self._ahead is None:
            self._ahead = _StreamAhead(self.windows, self._buffers, self._loader, self.paths)
        return self._ahead

    def arrived(self) -> int:
        """Bytes read so far by the reading :meth:`start` began (0 before it)."""
        return self._ahead.arrived() if self._ahead is not None else 0

    def close(self) -> None:
        """Stops the reading (waiting for its thread) and closes the files."""
        if self._group is not None:
            self._group.leave(self._finished)
        if self._loader is not None:
            self._loader.close()
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, w: _Window) -> tuple[Any, Any]:
        """Window ``w`` read on every rank of the group and exchanged: (its
        buffer to give back, its bytes); the reader thread runs this."""
        import torch

        group = self._group
        assert group is not None
        ranks, rank = group.size, group.rank
        offset, length = w.share(rank)
        path = self.paths[w.file]
        failure: BaseException | None = None
        code = 0
        base = buffer = None
        try:
            base, buffer = self._buffers.take(ranks * w.slot, w.file)
            if length:
                part = buffer[rank * w.slot : rank * w.slot + length]
                host = part if part.device.type == "cpu" else _aligned_empty(torch, length, torch.device("cpu"))
                self._loader.submit(w.file, offset, host.numpy()).wait_done()
                if host is not part:
                    part.copy_(host)
        except (OSError, ValueError) as exc:
            failure, code = exc, (getattr(exc, "errno", None) or errno_codes.EIO)
        loading = f"loading {path} bytes {w.start}..{w.end}"
        codes = [row[0] for row in _collective(group, f"{loading} (status exchange)", group.gather_ints, [code])]
        failed = [r for r, c in enumerate(codes) if c]
        if failed:
            r = failed[0]
            at, n = w.share(r)
            cause = failure if r == rank and failure is not None else os.strerror(codes[r])
            raise CollectiveLoadError(f"rank {rank}: rank {r} failed to read {path} bytes {at}..{at + n}: {cause}") from failure
        _collective(group, f"{loading} (exchange)", group.gather_slots, buffer, w.slot)
        if self._verifier is not None:
            # Here, in order, before the consumer sees (and may change) it.
            self._verifier.add(w, buffer, raising=False)
        return base, buffer

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        import torch

        wants, target = self._wants, self._target
        total = sum(t.nbytes for w in self.windows for t in w.tensors if wants(t.name))
        desc = _basename(self.paths[0]) if len(self.paths) == 1 else f"{len(self.paths)} files"
        callback, finish = resolve(self.progress, desc)
        done = 0
        windows: _StreamAhead | Generator[tuple[_Window, Any, Any, None], None, None]
        if self._group is None:
            windows = self.start()
        else:
            windows = _without_arrivals(_read_ahead(self.windows, self._read, self._buffers.wake))
        handed: list[Any] = []  # the recycled buffers of the windows handed out, last two
        windows_in_order = iter(windows)
        try:
            # Zero-byte tensors are read by no one; each rank makes its own.
            nothing = torch.empty(0, dtype=torch.uint8, device=target)
            for header in self.headers:
                for t in header.tensors:
                    if t.nbytes == 0 and wants(t.name):
                        yield t.name, _File(None, header, device_data=nothing).torch(t.name)
            while True:
                # The consumer is now two windows past the oldest buffer
                # it was handed: that one is free for the next window.
                if len(handed) == 2:
                    self._buffers.give(handed.pop(0))
                got = next(windows_in_order, None)
                if got is None:
                    break
                w, base, buffer, arrival = got
                if self._recycle:
                    handed.append(base)
                header = self.headers[w.file]
                view = _File(None, header, device_data=buffer, data_offset=w.start - header.data_start)
                # A window holding bytes this rank did not ask for (another
                # rank's tensors, or those read only to be verified) is not
                # kept alive by the tensors handed out: they are copies.
                # Recycled buffers are the caller's to copy from.
                partial = not self._recycle and any(not wants(t.name) for t in w.tensors)
                if self._verifier is not None and arrival is not None:
                    # The whole window first, hashed before the consumer
                    # sees (and may change) a byte of it.
                    arrival.wait_done()
                    self._verifier.add(w, buffer, raising=True)
                for t in w.tensors:
                    if wants(t.name):
                        if arrival is not None:
                            arrival.wait(header.data_start + t.end - w.start)
                        tensor = view.torch(t.name)
                        if tensor.device != target:
                            tensor = tensor.to(target)
                        elif partial:
                            tensor = tensor.clone()
                        yield t.name, tensor
                        done += t.nbytes
                        if callback is not None:
                            callback(done, total)
                if arrival is not None:
                    # A load that fails after its last byte (its end check)
                    # fails the iteration before the next window's tensors.
                    arrival.wait_done()
                del got, base, buffer, view
            if self._verifier is not None:
                self._verifier.agree(self._group)
            self._finished = True
        finally:
            # The reader thread stops (after the window it is on) before
            # the files it reads are closed.
            windows.close()
            finish()
            self.close()


class _Verify:
    """The running digest of each file of a verified stream: every byte of
    each file lies in its windows, in order (see :func:`_windows`), and
    each window's bytes are added once they are all in (with a group, the
    exchanged window: every rank's share), before any tensor of it is
    handed out, so the digest is the file's whoever read which part. A
    mismatch fails the stream at the file's last window, before its
    tensors, without a group, and on every rank at the end with one."""

    def __init__(self, paths: list[Source], digests: list[Any], sizes: list[int]) -> None:
        self.paths, self._digests, self.sizes = paths, digests, sizes
        self._hashed = [0] * len(paths)
        self._failure: OSError | None = None

    def add(self, w: _Window, buffer: Any, *, raising: bool) -> None:
        """Adds window ``w``'s bytes (``buffer``) past those already added
        (windows overlap by their alignment); at the file's end checks its
        digest: a mismatch is raised (``raising``) or kept for
        :meth:`agree`."""
        i = w.file
        fresh = buffer[self._hashed[i] - w.start : w.end - w.start]
        self._digests[i].update((fresh if fresh.device.type == "cpu" else fresh.cpu()).numpy())
        self._hashed[i] = w.end
        if w.end == self.sizes[i]:
            try:
                self._digests[i].check()
            except OSError as exc:
                if raising:
                    raise CollectiveLoadError(f"verify {self.paths[i]}: {exc}") from exc
                self._failure = self._failure or exc

    def agree(self, group: _Group | None) -> None:
        """Fails every rank of ``group`` where any rank's digest did not
        match."""
        if group is None:
            return
        code = (self._failure.errno or errno_codes.EBADMSG) if self._failure is not None else 0
        codes = [row[0] for row in _collective(group, "agreeing on the digests read", group.gather_ints, [code])]
        failed = [r for r, c in enumerate(codes) if c]
        if failed:
            cause = self._failure if self._failure is not None else os.strerror(codes[failed[0]])
            raise CollectiveLoadError(
                f"rank {group.rank}: the bytes the group read do not match the sums files (rank {failed[0]} "
                f"found it first: {cause}); no rank may use the tensors: a rank's copy differs from its sums file"
            ) from self._failure


class _Arrival:
    """How far the load of window ``w`` has come (a native
    ``_dmaload.Arrival``), its failure raised as a CollectiveLoadError
    naming the file and byte range."""

    def __init__(self, native: Any, path: Source, w: _Window) -> None:
        self._native, self._path, self._window = native, path, w

    def _raising_as_ours(self, wait: Callable[[], None]) -> None:
        try:
            wait()
        except (OSError, ValueError) as exc:
            w = self._window
            raise CollectiveLoadError(f"read of {self._path} bytes {w.start}..{w.end} failed: {exc}") from exc

    def wait(self, n: int) -> None:
        """Blocks (the GIL released, Ctrl-C raising KeyboardInterrupt) until
        bytes ``0..n`` are in; raises the load's failure once there is one."""
        self._raising_as_ours(lambda: self._native.wait(n))

    def wait_done(self) -> None:
        """Blocks until the load has ended; raises its failure (one that
        came after its last byte, at its end check, included)."""
        self._raising_as_ours(self._native.wait_done)

    def count(self) -> int:
        """Bytes ``0..n`` known to be in."""
        n: int = self._native.count()
        return n


def _read_ahead(
    windows: list[_Window], read: Callable[[_Window], Any], wake: Callable[[], None]
) -> Generator[tuple[_Window, Any], None, None]:
    """``(window, read(window))`` in order, the next window read by a thread
    while the caller handles this one. A failure is raised here, in order.
    ``wake`` unblocks a reader waiting for a buffer when the caller leaves."""
    if not windows:
        return
    ready: queue.Queue[tuple[_Window, Any, BaseException | None]] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def work() -> None:
        for w in windows:
            if stop.is_set():
                return
            try:
                ready.put((w, read(w), None))
            except BaseException as exc:  # handed to the consumer, raised there
                ready.put((w, None, exc))
                return

    thread = threading.Thread(target=work, name="dmaload-window-reader", daemon=True)
    thread.start()
    try:
        for _ in windows:
            w, result, failure = ready.get()
            if failure is not None:
                raise failure
            yield w, result
    finally:
        _stop_reader(thread, stop, wake, ready)


def _without_arrivals(
    exchanged: Generator[tuple[_Window, Any], None, None],
) -> Generator[tuple[_Window, Any, Any, None], None, None]:
    """A group's windows, each complete when handed over, as
    :class:`_StreamAhead` hands them (closing this closes ``exchanged``)."""
    try:
        for w, (base, buffer) in exchanged:
            yield w, base, buffer, None
    finally:
        exchanged.close()


class _StreamAhead:
    """``(window, buffer to give back, its bytes, its arrival)`` in order,
    each handed over once its load is queued: the loads run one after the
    other on ``loader`` (a native ``_dmaload.WindowLoader``, whose thread
    never takes the GIL), queued as far ahead as the ring has a free buffer
    and at most ``RING`` windows beyond the caller's, so the caller takes
    each tensor as soon as ``arrival.wait`` says its bytes are in, and
    ``arrival.wait_done`` before the next window. A failure is raised by
    those waits; ``close`` cancels the load under way and drops the rest."""

    def __init__(self, windows: list[_Window], buffers: _Buffers, loader: Any, paths: list[Source]) -> None:
        self._unqueued = collections.deque(windows)
        self._queued: collections.deque[tuple[_Window, Any, Any, _Arrival]] = collections.deque()
        self._buffers, self._loader, self._paths = buffers, loader, paths
        self._arrivals: list[_Arrival] = []
        self._queue()

    def _queue(self) -> None:
        """Queues the next windows' loads while a buffer is free and the
        memory check admits it: a window that does not fit waits for the
        consumer to free some, unless nothing is queued, when its
        OSError (ENOMEM) is raised."""
        while self._unqueued and len(self._queued) < RING:
            w = self._unqueued[0]
            unfaulted = sum(q.end - q.start - a.count() for q, _, _, a in self._queued)
            try:
                free = self._buffers.try_take(w.slot, w.file, unfaulted)
            except OSError:
                if self._queued:
                    return
                raise
            if free is None:
                return
            self._unqueued.popleft()
            base, buffer = free
            native = self._loader.submit(w.file, w.start, buffer[: w.end - w.start].numpy())
            arrival = _Arrival(native, self._paths[w.file], w)
            self._arrivals.append(arrival)
            self._queued.append((w, base, buffer, arrival))

    def arrived(self) -> int:
        """Bytes of the windows' ranges read so far."""
        return sum(a.count() for a in self._arrivals)

    def __iter__(self) -> _StreamAhead:
        return self

    def __next__(self) -> tuple[_Window, Any, Any, _Arrival]:
        self._queue()
        if not self._queued:
            raise StopIteration
        return self._queued.popleft()

    def close(self) -> None:
        self._loader.close()


def _stop_reader(
    thread: threading.Thread, stop: threading.Event, wake: Callable[[], None], ready: queue.Queue[Any]
) -> None:
    """Stops a reader thread once its consumer has left, and waits for it."""
    stop.set()
    wake()
    # Unblock a reader waiting to put its window, and let it finish.
    while thread.is_alive():
        try:
            ready.get_nowait()
        except queue.Empty:
            thread.join(timeout=0.01)
