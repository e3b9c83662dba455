"""The reports of a load and of a save, as dataclasses read from the core's
JSON: the native module hands each report over as that JSON, the same that
``dmaload load --json`` prints, so ``from_json`` is the one place a report's
fields cross into Python."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["Fallback", "LoadReport", "PageCacheResidency", "SaveReport"]


@dataclass(frozen=True)
class Fallback:
    """A path the loader did not take, and why (e.g. direct -> buffered)."""

    from_: str
    to: str
    reason: str


@dataclass(frozen=True)
class PageCacheResidency:
    """How much of the loaded range is in the page cache after the load
    (measured only when the load's ``measure_page_cache`` option asks)."""

    resident_bytes: int = 0
    fraction: float = 0.0


@dataclass(frozen=True)
class LoadReport:
    """What a load did and how long each part took (see the Rust `LoadReport`).

    Fields the native library reports but this version does not know are
    kept in ``extra``.
    """

    path: str = ""
    offset: int = 0
    bytes: int = 0
    engine: str = ""
    cache: str = ""
    memory: str = ""
    memory_reason: str = ""
    huge_pages: bool = False
    destination: str = ""
    filesystem: str = ""
    alignment: int = 0
    chunk_size: int = 0
    gather_size: int = 0
    queue_depth: int = 0
    request_size: int = 0
    """Bytes one read request asked for at most (``chunk_size`` unless tuned)."""
    tuning_windows: int = 0
    """Windows of 128 MiB the reads' tuning measured (0: not tuned)."""
    read_choice: str = ""
    """How an ``auto`` load chose direct or buffered reads (``cache`` says which):
    ``"measured: direct R GiB/s, buffered ... R GiB/s"``, the same after
    ``"re-measured, ..."``, ``"remembered"``, or ``""`` where nothing was chosen."""
    fallbacks: tuple[Fallback, ...] = ()
    alloc_seconds: float = 0.0
    register_seconds: float = 0.0
    first_gather_seconds: float = 0.0
    deliver_seconds: float = 0.0
    ring_bytes: int = 0
    """Of ``bytes``, those a staged load read through its staging ring."""
    cache_lane_bytes: int = 0
    """Of ``bytes``, those a device load's cache lane copied from the page cache."""
    cache_lane_threads: int = 0
    io_seconds: float = 0.0
    waited_for_memory_seconds: float = 0.0
    total_seconds: float = 0.0
    gib_per_second: float = 0.0
    cpu_user_seconds: float = 0.0
    cpu_system_seconds: float = 0.0
    page_cache: PageCacheResidency | None = None
    """``None`` unless the load measured it (``measure_page_cache=True``)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str, path: str | None = None) -> LoadReport:
        """The report from the native JSON; ``path``, when given, replaces the
        JSON's (which holds U+FFFD for bytes of a name that are not UTF-8) with
        the ``os.fsdecode`` form that names the file exactly."""
        data = json.loads(text)
        if path is not None:
            data["path"] = path
        pc = data.get("page_cache")
        if pc is not None:
            data["page_cache"] = PageCacheResidency(
                resident_bytes=int(pc.get("resident_bytes", 0)), fraction=float(pc.get("fraction", 0.0))
            )
        return _from_fields(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SaveReport:
    """What a save did and how long each part took (see the Rust `SaveReport`).

    ``path`` is the path as given, ``target`` the file written after
    following symbolic links; ``file_type`` is ``"regular file"`` (replaced
    through a temporary file and a rename) or the device or FIFO written in
    place (``in_place``). ``cache`` says what happened to the page cache:
    ``"bypass"`` (O_DIRECT), ``"keep"`` or ``"fadvise"`` (dropped after the
    sync, ``mode="dontcache"``); ``direct_bytes`` were written with O_DIRECT
    at offsets aligned to ``alignment``, the rest buffered. ``replaced`` is
    true when a file was there before, ``anonymous_tmpfile`` when the
    temporary file was an unnamed ``O_TMPFILE``; ``other_links`` counts the replaced
    file's other hard links (which keep the old bytes);
    ``removed_tmpfiles`` names temporary files of crashed saves cleared from
    the directory. ``allocate_seconds``, ``write_seconds`` and
    ``sync_seconds`` (fsync and rename) are parts of ``total_seconds``.
    Fields the native library reports but this version does not know are
    kept in ``extra``.
    """

    path: str = ""
    target: str = ""
    file_type: str = ""
    in_place: bool = False
    bytes: int = 0
    engine: str = ""
    cache: str = ""
    filesystem: str = ""
    alignment: int = 0
    direct_bytes: int = 0
    fallbacks: tuple[Fallback, ...] = ()
    anonymous_tmpfile: bool = False
    replaced: bool = False
    other_links: int = 0
    removed_tmpfiles: tuple[str, ...] = ()
    allocate_seconds: float = 0.0
    write_seconds: float = 0.0
    sync_seconds: float = 0.0
    total_seconds: float = 0.0
    gib_per_second: float = 0.0
    cpu_user_seconds: float = 0.0
    cpu_system_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str, path: str | None = None, target: str | None = None) -> SaveReport:
        """The report from the native JSON; ``path`` and ``target``, when
        given, replace the JSON's with the ``os.fsdecode`` forms (as for
        ``LoadReport.from_json``)."""
        data = json.loads(text)
        if path is not None:
            data["path"] = path
        if target is not None:
            data["target"] = target
        data["removed_tmpfiles"] = tuple(data.get("removed_tmpfiles", ()))
        return _from_fields(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_Report = TypeVar("_Report", LoadReport, SaveReport)


def _from_fields(cls: type[_Report], data: dict[str, Any]) -> _Report:
    """``cls`` from a report's JSON fields: the fallbacks as ``Fallback``
    records, and the fields this version does not know kept in ``extra``."""
    known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in known}
    kwargs["fallbacks"] = tuple(
        Fallback(from_=f.get("from", ""), to=f.get("to", ""), reason=f.get("reason", ""))
        for f in data.get("fallbacks", ())
    )
    kwargs["extra"] = {k: v for k, v in data.items() if k not in known}
    return cls(**kwargs)
