"""Load options shared by every entry point.

The names and values are the core's (``dmaload::LoadOptions``): the tests
check these types against the native module's ``_option_choices()`` and
``_option_defaults()``, so a change on one side that the other lacks fails.
"""

from __future__ import annotations

from typing import Any, Collection, Literal, Mapping, TypeAlias, TypedDict, Union

from . import _dmaload

Engine: TypeAlias = Literal["uring-fixed", "uring", "pread-pool", "read"]
Mode: TypeAlias = Literal["auto", "direct", "buffered", "dontcache"]
Destination: TypeAlias = Literal["auto", "memfd", "memfd-huge", "hugetlb", "anonymous-thp", "anonymous"]
"""Where a host load's bytes go (``to=``): ``auto`` or a host memory kind."""
DMABUF_DESTINATIONS = ("udmabuf", "dmabuf", "dma-heap:NAME")
"""The dma-buf forms ``to`` takes in the core, ``NAME`` a heap in
``/dev/dma_heap``: ``dmaload.load_dmabuf`` loads them (a :class:`dmaload.DmaBuf`
owning an fd); ``dmaload.load`` refuses them (``OSError`` EINVAL)."""
DEVICE_DESTINATIONS = ("cuda:N",)
"""The other forms ``to`` takes in the core, ``N`` a device number. A
:class:`dmaload.Buffer` cannot live on a device, so ``dmaload.load`` refuses
them (``OSError`` EINVAL); the safetensors loaders take ``device="cuda:N"``."""
Size: TypeAlias = Union[int, str]


class LoadOptions(TypedDict, total=False):
    """Keyword options of every load (all optional; the defaults are the core's).

    engine: how the file is read (default ``"uring-fixed"``).
    mode: ``"auto"`` (direct or buffered without page-cache residue,
        whichever measures faster for the device, ``LoadReport.read_choice``;
        buffered where direct I/O is not possible; the default), ``"direct"`` (or an error), ``"buffered"`` or
        ``"dontcache"``.
    to: where the bytes go: ``"auto"`` (the default: the cheapest memory
        this kernel gives, huge pages where it allows; a memfd for
        ``dmaload.load``, possibly anonymous memory for the safetensors
        loaders; ``report.memory_reason`` says why), ``"memfd"`` (4 KiB
        pages, shareable by fd), ``"memfd-huge"`` (a memfd with 2 MiB pages,
        where shmem_enabled allows), ``"hugetlb"`` (a memfd from the hugetlb
        pool), ``"anonymous-thp"`` (no fd, transparent huge pages) or
        ``"anonymous"`` (no fd, 4 KiB pages: the cheapest to populate). A kind the kernel cannot give
        is an ``OSError`` saying why. (The safetensors loaders choose a
        device with ``device=`` instead; ``to`` picks the host memory of a
        cpu load.)
    gather_size, chunk_size: bytes (an int, or a string such as ``"128M"``;
        default 128 MiB and 4 MiB), rounded as ``dmaload load --help`` says.
    queue_depth: requests in flight (io_uring engines, tuned per block
        device for direct reads when left at the default; default 32).
    threads: threads of the pread-pool engine (default 8).
    populate_threads: threads populating memory ahead of the reads
        (default: one per CPU, 1 to 4).
    measure_page_cache: after the load, measure how much of the range is in
        the page cache (``mincore`` over the whole range, outside the timed
        load) into ``report.page_cache`` (default ``False``: not measured,
        ``report.page_cache`` is ``None``).
    verify: check each file against the digest that the ``B3SUMS``
        (BLAKE3) or ``SHA256SUMS`` file beside it records (what ``b3sum``
        or ``sha256sum`` writes; ``dmaload sums [--digest blake3]`` writes
        one; BLAKE3 first when both list the file), hashing the bytes as
        they arrive (default ``False``).
        A mismatch is an ``OSError`` (errno ``EBADMSG``) naming the file and
        both digests; a missing sums file or a file it does not list is an
        ``OSError`` (``EINVAL``); either way no buffer or tensor is returned.
        Whole files, on every path (``load``, ``load_into`` of a whole file,
        the safetensors loaders to the CPU or a device, whose header and
        data are both checked); a part of a file is refused (``EINVAL``)
        before anything is read. With ``cache=`` the file is loaded directly.
    staging_slots, staging_slot_size: the pinned staging ring of a device
        load (``device="cuda:N"``; default slots of 16 MiB, one read each,
        as many as the disk's reads keep in flight and two more, no more
        than a quarter of the data, at most 32), and the ring of
        ``load_dmabuf`` to ``"dma-heap:NAME"`` (default: at most 128 MiB,
        sized from the range); host loads ignore them. At least 2 slots, each of at most
        1 GiB (an ``OSError``, ``EINVAL``, otherwise; the core's check).
    """

    engine: Engine
    mode: Mode
    to: Destination
    gather_size: Size
    chunk_size: Size
    queue_depth: int
    threads: int
    populate_threads: int
    measure_page_cache: bool
    verify: bool
    staging_slots: int
    staging_slot_size: Size


def parse_size(value: Size) -> int:
    """``4096``, ``"4096"``, ``"4K"``, ``"128M"``, ``"1.5G"`` (binary units),
    read by the core's parser (the one the command line uses)."""
    if isinstance(value, bool):
        raise TypeError("a size must be an int or a string such as '128M'")
    if isinstance(value, int):
        return value
    return _dmaload.parse_size(str(value))


class DmabufLoadOptions(TypedDict, total=False):
    """Keyword options of ``dmaload.load_dmabuf``: those of :class:`LoadOptions`
    but ``to`` (its own argument); the staging ring's size a load to
    ``"dma-heap:NAME"``."""

    engine: Engine
    mode: Mode
    gather_size: Size
    chunk_size: Size
    queue_depth: int
    threads: int
    populate_threads: int
    measure_page_cache: bool
    verify: bool
    staging_slots: int
    staging_slot_size: Size


class SaveOptions(TypedDict, total=False):
    """Keyword options of ``dmaload.save`` (all optional; the defaults are
    the core's ``dmaload::SaveOptions``). The names and values are those of
    :class:`LoadOptions` where a write has the same knob.

    engine: how the bytes are written (default ``"uring-fixed"``;
        ``"pread-pool"`` is a pool of threads issuing ``pwrite``, ``"read"``
        one thread of sequential writes).
    mode: ``"auto"`` (O_DIRECT where the filesystem and the data's address
        allow, else buffered; the default), ``"direct"`` (or an error),
        ``"buffered"`` or ``"dontcache"`` (buffered, then the file's pages
        are dropped from the page cache after the sync).
    sync: fsync the file before the rename and its directory after it
        (default ``True``). ``False``, for scratch data: a crash of the
        machine may lose the new file, but a killed process still never
        leaves a torn one.
    chunk_size: bytes per write request (an int, or a string such as
        ``"4M"``; default 4 MiB).
    queue_depth: writes in flight (io_uring engines; default 32).
    threads: threads of the pread-pool engine (default 8).
    """

    engine: Engine
    mode: Mode
    sync: bool
    chunk_size: Size
    queue_depth: int
    threads: int


def _checked(options: Mapping[str, Any], allowed: Collection[str], what: str) -> dict[str, Any]:
    """``options`` with its names checked against ``allowed`` and sizes in bytes."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"unknown {what} option(s): {', '.join(unknown)} (known: {', '.join(allowed)})")
    out = dict(options)
    for key in ("gather_size", "chunk_size", "staging_slot_size"):
        if out.get(key) is not None:
            out[key] = parse_size(out[key])
    return out


def native_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``options`` dict the native entry points take: the names checked
    against :class:`LoadOptions` and sizes in bytes. Each entry point uses
    the options that apply to it (a host load ignores the staging ring; a
    device load the host memory's ``to``, ``gather_size`` and
    ``populate_threads``)."""
    return _checked(options, LoadOptions.__annotations__.keys(), "load")


def native_save_options(options: Mapping[str, Any]) -> tuple[bool | None, dict[str, Any]]:
    """``sync`` (None: the core's default) and the ``options`` dict that
    ``_dmaload.save`` takes: the names checked against :class:`SaveOptions`,
    sizes in bytes."""
    out = _checked(options, SaveOptions.__annotations__.keys(), "save")
    return out.pop("sync", None), out
