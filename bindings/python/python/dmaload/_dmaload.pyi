"""Type stubs of the native module (checked with ``python -m mypy.stubtest``)."""

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, NoReturn, Protocol, TypeAlias, final

from ._header import Header
from ._report import LoadReport, SaveReport

class _HasFileno(Protocol):
    def fileno(self) -> int: ...

# A connected AF_UNIX SOCK_SEQPACKET socket, or its file descriptor.
_SocketLike: TypeAlias = _HasFileno | int

# The load options of every entry point as one dict, built by
# ``dmaload._options.native_options``: the names of ``LoadOptions``, sizes in
# bytes; an unknown name or a wrong type is a TypeError naming it. A save's
# (``native_save_options``) has the names of ``SaveOptions`` but ``sync``.
_Options: TypeAlias = dict[str, str | int | bool | None]

__all__ = [
    "BlockQueue",
    "Arrival",
    "Buffer",
    "DmaBuf",
    "LeasedFile",
    "MAX_HEADER_LEN",
    "SafetensorError",
    "SafetensorsFile",
    "StreamDigest",
    "WindowLoader",
    "check_device_memory",
    "default_cache_socket",
    "evict",
    "load",
    "load_cached",
    "load_dmabuf",
    "load_into",
    "load_safetensors",
    "open_safetensors",
    "parse_safetensors_header",
    "parse_size",
    "read_safetensors_header",
    "release_staging",
    "resolve_model",
    "tensor_index",
    "safetensors_dtypes",
    "save",
    "__version__",
    "_check_load_options",
    "_load_staged",
    "_option_choices",
    "_option_defaults",
    "_save_option_defaults",
    "_test_panic",
]

__version__: Final[str]
MAX_HEADER_LEN: Final[int]

class SafetensorError(ValueError):
    """A malformed safetensors file: the message says what is wrong and at which byte."""

@final
class Buffer:
    """Bytes loaded from a file, in memfd (or anonymous) memory.

    Views (memoryview, ``numpy.frombuffer``, ``torch.frombuffer``, DLPack,
    and slices of each) never outlive the memory: ``close()`` only stops
    new views, drops the fd and makes ``len()`` 0 (it raises BufferError
    while buffer-protocol exports are alive); the mapping is released when
    the last reference to the Buffer goes, and every view holds one.
    Cannot be pickled or copied (TypeError). Any internal failure of the
    native code is a RuntimeError, never a PanicException.

    A process forked after the load (``os.fork()``, multiprocessing's
    ``fork`` start method, DataLoader workers) gets its own copy of the bytes,
    as of any other object: just before the fork the buffer's mapping is made
    private copy-on-write, so neither process's later in-place writes reach
    the other, and views made before the fork keep working in both. (Where
    that cannot be done, hugetlb memory whose pool lacks the pages a private
    mapping reserves or a kernel before 5.16, the fork goes on with the memory
    shared and a line on stderr says so.) The memfd (``fileno()``,
    ``dup_memfd()``, ``send()``) is handed out only while it holds the bytes
    the buffer shows: once the buffer's memory is private (received, its
    memfd handed out before, or a fork since the load) and written in place,
    these raise OSError rather than give others bytes the buffer does not
    show; copy the bytes into a new buffer to share them.
    """

    def __len__(self) -> int: ...
    # The buffer protocol (PEP 688). CPython < 3.12 has no Python-level
    # __buffer__ even though the type exports buffers: allowlisted for
    # stubtest in stubtest-allowlist.txt.
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def exports(self) -> int: ...
    def __enter__(self) -> Buffer: ...
    def __exit__(self, *_args: object) -> bool: ...
    def fileno(self) -> int: ...
    def dup_memfd(self) -> int: ...
    def send(self, socket: _SocketLike) -> None: ...
    @staticmethod
    def receive(socket: _SocketLike) -> Buffer: ...
    @property
    def memfd_offset(self) -> int: ...
    @property
    def memory(self) -> str: ...
    @property
    def segments(self) -> list[tuple[int, int]]: ...
    @property
    def path(self) -> str: ...
    @property
    def report_json(self) -> str: ...
    @property
    def report(self) -> LoadReport: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def __reduce__(self) -> NoReturn:
        """Raises TypeError: a Buffer cannot be pickled or copied."""

def load(
    file: str | os.PathLike[str] | int,
    offset: int | None = None,
    length: int | None = None,
    *,
    options: _Options | None = None,
    progress: Callable[[int, int], Any] | None = None,
) -> Buffer: ...
def load_into(
    path: str | os.PathLike[str],
    target: Buffer | bytearray | memoryview | Any,
    offset: int = 0,
    *,
    options: _Options | None = None,
    progress: Callable[[int, int], Any] | None = None,
    arrived: Callable[[int], Any] | None = None,
) -> LoadReport: ...
def load_cached(
    file: str | os.PathLike[str] | int,
    socket: str | os.PathLike[str],
    *,
    options: _Options | None = None,
    fallback: bool = True,
) -> tuple[Buffer | None, str | None, str | None]: ...
def default_cache_socket() -> str: ...
def evict(path: str | os.PathLike[str]) -> None: ...
def load_safetensors(
    paths: list[str] | list[os.PathLike[str]],
    *,
    concurrency: int = 4,
    options: _Options | None = None,
    progress: Callable[[int, int], Any] | None = None,
) -> list[tuple[Buffer, Header]]: ...
@final
class WindowLoader:
    """Loads of ranges of ``files`` (each opened once, here: a path, a
    descriptor, or an ``s3://`` URL looked up once) into buffers
    the caller gives, started in the order submitted, ``in_flight`` at a
    time, on threads of the loader's own that never take the GIL (where no
    thread can be created, ``submit`` loads at once). A failed load ends
    the loader: later loads are not run and fail saying so."""

    def __new__(
        cls, files: Sequence[str | os.PathLike[str] | int], *, options: _Options | None = None, in_flight: int = 1
    ) -> WindowLoader:
        """``in_flight`` loads run at once, each on a thread."""
    def submit(
        self,
        file: int,
        offset: int,
        target: bytearray | memoryview | Any,
        *,
        arrived: Callable[[int], Any] | None = None,
    ) -> Arrival:
        """Queues the load of ``len(target)`` bytes of ``files[file]`` from
        ``offset`` into ``target`` (exported until the load ends).
        ``arrived(n)``, for watching a load, runs with the GIL on the
        loader's threads after each report."""
    def header(self, file: int) -> Header:
        """The safetensors header of ``files[file]``, read from the
        loader's own open (an object's pinned to its ETag)."""
    def digest(self, file: int) -> StreamDigest:
        """The digest to come of object ``file``, against the ``B3SUMS`` or
        ``SHA256SUMS`` object beside it; OSError (EINVAL) when none lists
        it, ValueError for a file."""
    def size(self, file: int) -> int:
        """The size of file or object ``file`` as the loader opened it."""
    def object_identity(self, file: int) -> str | None:
        """``"s3://BUCKET/KEY ETAG SIZE"`` for an object, None for a file."""
    def check_memory(self, file: int, n: int) -> None:
        """OSError (ENOMEM, naming ``files[file]``) unless ``n`` more bytes
        of memory are available: the check a load into fresh memory makes
        (the memory cgroup's headroom and MemAvailable)."""
    def close(self) -> None:
        """Cancels the load under way, fails the queued ones; idempotent."""

@final
class StreamDigest:
    """The digest of a file a stream hands over window by window, in file
    order, against the one its ``B3SUMS`` or ``SHA256SUMS`` records (the
    core's lookup); OSError (EINVAL) when no sums file lists it."""

    def __new__(cls, path: str | os.PathLike[str]) -> StreamDigest: ...
    @property
    def sums_file(self) -> str:
        """``"B3SUMS"`` or ``"SHA256SUMS"``: the one that lists the file."""
    @property
    def expected(self) -> str:
        """The recorded digest, in hex."""
    def update(self, data: bytearray | memoryview | Any) -> None:
        """Adds the next bytes of the file (a writable C-contiguous
        buffer), hashed with the GIL released."""
    def check(self) -> None:
        """OSError (EBADMSG, naming the sums file and both digests) unless
        the bytes added hash to the recorded digest. Once only."""

@final
class Arrival:
    """How far one load of a :class:`WindowLoader` has come. The waits
    release the GIL and raise KeyboardInterrupt on Ctrl-C, and raise the
    load's failure (OSError naming operation, file and offset) once there
    is one."""

    def wait(self, n: int) -> None:
        """Until bytes ``0..n`` of the target hold the file's bytes
        (ValueError where the load ended with fewer)."""
    def wait_done(self) -> None:
        """Until the load has ended."""
    def count(self) -> int:
        """Bytes ``0..n`` known to hold the file's bytes."""

@final
class LeasedFile:
    """A warm file mapped privately under its read lease (see the core's
    ``dmaload::lease``): raises OSError where it is not mapped."""

    def __new__(cls, path: str | os.PathLike[str]) -> LeasedFile: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...
    @property
    def broken(self) -> bool: ...
    @property
    def path(self) -> str: ...

@final
class SafetensorsFile:
    """A safetensors file opened once, its header validated; ``_load_staged``
    reads its data from this same open file."""

    @property
    def header(self) -> Header: ...
    @property
    def path(self) -> str: ...
    @property
    def data_start(self) -> int: ...
    @property
    def data_len(self) -> int: ...

def open_safetensors(
    file: str | os.PathLike[str] | int, length: int | None = None, name: str | os.PathLike[str] | None = None
) -> SafetensorsFile: ...
def _load_staged(
    files: list[SafetensorsFile],
    targets: list[Any],
    device: int,
    *,
    options: _Options | None = None,
    progress: Callable[[int, int], Any] | None = None,
    keep: list[Any] | None = None,
    socket: str | os.PathLike[str] | None = None,
) -> list[LoadReport]:
    """Loads each file's data section through a staging ring into ``targets``:
    device pointers (ints) of CUDA device ``device``, each ``file.data_len``
    bytes of device memory alive and unused by anything else until the call
    returns, or, when Ctrl-C left a held read to the load's thread, until
    that thread ends: pass their owners (the tensors) as ``keep``, which
    the load holds until then; or, when ``device`` is -1, writable
    C-contiguous buffers (``tensor.numpy()``, ``bytearray``) of exactly
    ``file.data_len`` bytes, no two sharing a byte (``ValueError``).

    With ``socket`` (device targets only), the cache service there copies
    each whole file into the device memory from its own pinned copy: each
    target must then follow ``file.data_start`` bytes of the same
    allocation, where the header goes. A file the service cannot fill (none
    answers, another user, no such device in the service, the driver
    refuses the IPC handle) takes the staging ring, and its report's
    ``fallbacks`` says why."""

def check_device_memory(device: int, need: int, path: str | os.PathLike[str]) -> None:
    """Raises ``OSError`` (ENOMEM, naming both figures) where ``need`` bytes
    do not fit in what CUDA device ``device`` has free: the check the
    core's own device loads make; ``path`` names the load."""

def release_staging() -> int:
    """Frees the staging rings kept for later device loads (one per device,
    pinned); returns their bytes."""

@final
class DmaBuf:
    """A dma-buf holding a range of a file, owning its fd until ``close()``
    or ``detach()``; ``tobytes()`` copies the bytes out through a fresh,
    SYNC-bracketed mapping."""

    def fileno(self) -> int: ...
    def detach(self) -> int: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def size(self) -> int: ...
    @property
    def data_offset(self) -> int: ...
    def __len__(self) -> int: ...
    @property
    def report(self) -> LoadReport: ...
    def tobytes(self) -> bytes: ...
    def __enter__(self) -> DmaBuf: ...
    def __exit__(self, exc_type: object, exc: object, tb: object) -> None: ...

def load_dmabuf(
    path: str | os.PathLike[str],
    offset: int | None = None,
    length: int | None = None,
    *,
    options: _Options | None = None,
) -> DmaBuf: ...
def read_safetensors_header(path: str | os.PathLike[str]) -> Header: ...
def parse_safetensors_header(data: bytes, file_len: int | None = None) -> Header: ...
def resolve_model(path: str | os.PathLike[str]) -> tuple[list[str], list[tuple[str, str]] | None]:
    """The model at ``path`` as the core resolves it: its shard files (or
    shard object URLs, for an ``s3://`` key, index or prefix), and its
    index's weight map as (tensor, normalized shard name) pairs in
    the index's order (``None`` without an index)."""

def tensor_index(
    tables: Sequence[tuple[str | os.PathLike[str], Sequence[str]]], weight_map: dict[str, str] | None
) -> dict[str, int]:
    """Which of ``tables`` (each shard's path and tensor names, in the order
    ``resolve_model`` gave the shards) holds each tensor, checked by the
    core against each other and ``weight_map`` (tensor name to shard name,
    ``None`` without an index): name to position, in the tables' order.
    ``SafetensorError`` for a tensor in two shards, one the map puts in a
    shard that lacks it, or one the map does not list."""

def safetensors_dtypes() -> list[tuple[str, int]]: ...
def _option_choices() -> dict[str, list[str]]:
    """For the tests: the values of each enumerated option as the core
    names them (``engine``, ``mode``, and ``to``'s forms, ``cuda:N`` for
    any device)."""

def parse_size(text: str) -> int:
    """A size ("4096", "128M", "1.5GiB") in bytes: the core's parser.
    ValueError if it is not one."""

def _check_load_options(options: _Options | None = None) -> None:
    """Checks load options as a load would before it opens a file (names,
    types, values) without loading: TypeError, ValueError or OSError
    (EINVAL) saying which is wrong."""

def _option_defaults() -> dict[str, str | int | bool]:
    """For the tests: every load option the binding takes, with the core's
    default."""

def save(
    data: Any,
    path: str | os.PathLike[str],
    *,
    sync: bool | None = None,
    options: _Options | None = None,
    progress: Callable[[int, int], Any] | None = None,
) -> SaveReport:
    """Writes the bytes of ``data`` (a C-contiguous buffer of unsigned
    bytes, exported for the whole call and never copied) to ``path`` with
    the GIL released: a regular file replaced atomically, a device or FIFO
    written in place. ``options`` holds the names of ``SaveOptions`` but
    ``sync``; ``sync`` None is the core's default."""

def _save_option_defaults() -> dict[str, str | int | bool]:
    """For the tests: every save option the binding takes, with the core's
    default."""

def _test_panic(place: str) -> None:
    """For the tests: a deliberate panic ("gil", "detached" or "load"), raised as RuntimeError."""

@final
class BlockQueue:
    """One end of a ring of blocks shared with another process.

    One process creates it and sends it over a connected ``AF_UNIX``
    ``SOCK_SEQPACKET`` socket; the other attaches and takes the other role.
    Blocks cross into Python as copies (``bytes`` out, any bytes-like object
    in): the peer may write a block at any moment if it breaks the protocol,
    so no view of the shared ring is handed out. Waits release the GIL, and
    a call on an end another thread is using waits for it with the GIL
    released (other threads run on). ``put``, ``get`` and ``wait_drained``
    answer Ctrl-C: the wait looks for signals every 20 ms and raises
    ``KeyboardInterrupt`` (or a signal handler's exception), having taken
    no block, so the queue is left as it was (``create`` and ``attach``
    wait for the peer without looking). A timeout is TimeoutError, a peer
    that went away BrokenPipeError, a corrupt control page OSError(EPROTO).
    """

    @staticmethod
    def create(
        sock: socket.socket | int,
        role: Literal["producer", "consumer"] | str,
        block_size: int = 1048576,
        blocks: int = 32,
        memory: Literal["memfd", "dma-heap", "udmabuf"] | str = "memfd",
        timeout: float | None = None,
    ) -> BlockQueue: ...
    @staticmethod
    def attach(sock: socket.socket | int, timeout: float | None = None) -> BlockQueue: ...
    def put(self, data: bytes | bytearray | memoryview, tag: int = 0, timeout: float | None = None) -> int: ...
    def try_put(self, data: bytes | bytearray | memoryview, tag: int = 0) -> bool: ...
    def get(self, timeout: float | None = None) -> tuple[int, bytes] | None: ...
    def finish(self) -> None: ...
    def wait_drained(self, timeout: float | None = None) -> None: ...
    def wait_fd(self) -> int: ...
    def prepare_wait(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> BlockQueue: ...
    def __exit__(self, *_args: object) -> bool: ...
    @property
    def role(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def blocks(self) -> int: ...
    @property
    def memory(self) -> str: ...
    @property
    def count(self) -> int: ...
