"""What the engine loaders share: their options and the weights iterator."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _dmaload
from .._cache import Cache, socket_for
from .._options import LoadOptions, native_options, parse_size
from .._report import LoadReport
from ..safetensors import TensorFilter, safe_open
from ..safetensors._collective import Stream
from ._mapped import Mapped

EXTRA_CONFIG_KEYS = ("window", "collective", "cache", *LoadOptions.__annotations__)
"""The keys of ``--model-loader-extra-config`` the loaders take (documented
in README.md, "Serving engines"): ``window`` (bytes read and exchanged at a
time, an int or ``"64M"``; 64 MiB by default, each window one load whose
tensors are handed out as their bytes arrive),
``collective`` (``false``: every rank reads the
whole checkpoint itself instead of 1/N of it), ``cache`` (``true`` or the
model-cache service's socket; ``DMALOAD_CACHE`` in the environment does the
same) and every option of :class:`dmaload.LoadOptions` (``engine``,
``mode``, ``chunk_size``, ``queue_depth``, ``staging_slots``, ...)."""


@dataclass(frozen=True)
class EngineKeys:
    """What an engine's default loader does with the extra-config keys it
    knows, once dmaload reads the weights: ``kept`` keys keep their meaning
    (the engine's loader reads them; each maps to the type its value must
    have), ``refused`` keys select a reader of the engine's own that
    ``--load-format dmaload`` replaces (each maps to why)."""

    engine: str
    kept: dict[str, type] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    own: dict[str, type] = field(default_factory=dict)
    """Keys that engine's dmaload loader takes itself (each maps to the
    type its value must have); left in the extra config for it to take."""


@dataclass(frozen=True)
class LoaderConfig:
    """The loader's options, from an engine's extra config."""

    window: int | None = None
    collective: bool = True
    cache: Cache = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def take(cls, extra: dict[str, Any], engine: EngineKeys | None = None) -> LoaderConfig:
        """The options among ``extra``, removed from it; what is left is
        ``engine``'s kept keys. Every key and value is checked here, where
        the config is read: a key neither dmaload's nor kept, a refused key
        or a bad value is a ``ValueError`` naming the key and listing the
        keys there are (without ``engine``, every other key is left to the
        caller)."""
        if engine is not None:
            _check_engine_keys(extra, engine)
        mine = {k: extra.pop(k) for k in list(extra) if k in EXTRA_CONFIG_KEYS}
        window = mine.pop("window", None)
        if window is not None:
            try:
                window = parse_size(window)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"dmaload: window: {exc}") from None
            if window < 1:
                raise ValueError(f"dmaload: window must be at least 1 byte, not {window}")
        collective = mine.pop("collective", True)
        if not isinstance(collective, bool):
            raise ValueError(f"dmaload: collective must be true or false, not {collective!r}")
        cache = mine.pop("cache", None)
        if cache is not None and not (isinstance(cache, bool) or (isinstance(cache, str) and cache)):
            raise ValueError(f"dmaload: cache must be true, false or a socket path, not {cache!r}")
        try:
            # The names, types and values, as a load checks them before it
            # opens a file: a bad one fails here, not inside the first load.
            _dmaload._check_load_options(native_options(mine))
        except OSError as exc:  # a value out of range: the core's words
            raise ValueError(f"dmaload: {exc.strerror}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"dmaload: {exc}") from None
        return cls(window, collective, cache, mine)


def _check_engine_keys(extra: dict[str, Any], engine: EngineKeys) -> None:
    listed = (
        f"dmaload's keys: {', '.join(EXTRA_CONFIG_KEYS)}; "
        f"{engine.engine}'s that keep their meaning: {', '.join(engine.kept) or 'none'}"
        + (f"; dmaload's for {engine.engine}: {', '.join(engine.own)}" if engine.own else "")
    )
    allowed = {**engine.kept, **engine.own}
    for key, value in extra.items():
        if key in EXTRA_CONFIG_KEYS:
            continue
        if key in engine.refused:
            raise ValueError(
                f"dmaload: model_loader_extra_config key {key!r} is refused with load format 'dmaload': "
                f"{engine.refused[key]} ({listed})"
            )
        if key not in allowed:
            raise ValueError(f"dmaload: unknown model_loader_extra_config key {key!r} for load format 'dmaload' ({listed})")
        if value is not None and not isinstance(value, allowed[key]):
            raise ValueError(
                f"dmaload: model_loader_extra_config key {key!r} takes a {allowed[key].__name__}, not {value!r}"
            )


def world_device_group(get_world_group: Callable[[], Any]) -> Any:
    """An engine's world device group (its ``get_world_group()``) when there
    are several ranks, else None; None too where no world group exists (a
    loader used outside an engine)."""
    try:
        world = get_world_group()
    except AssertionError:
        return None
    return world.device_group if world.world_size > 1 else None


@dataclass
class EarlyRead:
    """A read of an engine's checkpoint begun before the engine asks for
    the weights (:func:`start_early`), which :func:`weights` takes over."""

    stream: Stream | Mapped
    started: float
    """``time.perf_counter()`` when it began."""
    taken: bool = False
    """Whether :func:`weights` has taken it over (once only)."""
    unmapped: str = ""
    """Why the files are read, not mapped (empty when mapped)."""

    @property
    def paths(self) -> Sequence[Path | str]:
        return self.stream.paths

    def close(self) -> None:
        """Stops the read (its thread is waited for) and closes the files."""
        self.stream.close()


def start_early(files: Sequence[str], device: Any, config: LoaderConfig) -> EarlyRead | None:
    """This process's read of ``files`` (one rank: no group), begun now, in
    the window buffers :func:`weights` will hand tensors out of (at most
    five windows, as there), or None where it cannot begin before the
    engine asks (a model-cache service: the files come whole from it)."""
    if socket_for(config.cache) is not None:
        return None
    started = time.perf_counter()
    mapped = Mapped.open(files, device, None, plain=_plain(config, None))
    if isinstance(mapped, Mapped):
        return EarlyRead(mapped, started)
    stream = Stream(
        [Path(f) for f in files], None, device, window=config.window, recycle=True, options=dict(config.options)
    )
    try:
        stream.start()
    except BaseException:
        stream.close()
        raise
    return EarlyRead(stream, started, unmapped=mapped)


def _plain(config: LoaderConfig, group: Any) -> bool:
    """Whether a load may map the files: no option of dmaload's given
    (each chooses how the files are read) and no collective read."""
    return not config.options and config.window is None and group is None


def _stream_reads(stream: Stream, rank: int) -> int:
    """The bytes of its checkpoint ``stream`` has this rank read once it
    has run to the end: each file's header, and this rank's share of every
    window of the plan (1/N with N ranks; the tensors a filter leaves out
    are never read)."""
    headers = sum(h.data_start for h in stream.headers)
    return headers + sum(w.share(rank)[1] for w in stream.windows)


def weights(
    files: Sequence[str],
    device: Any,
    config: LoaderConfig,
    *,
    process_group: Any = None,
    tensor_filter: TensorFilter = None,
    show_progress: bool = True,
    log: logging.Logger,
    bar_format: str | None = None,
    tqdm_position: Callable[[], int] | None = None,
    early: EarlyRead | None = None,
) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for each tensor of ``files`` this rank wants, on
    ``device``, read once across ``process_group`` (when several ranks load
    the same files); a tqdm bar in bytes (so with GB/s) where
    ``show_progress``, and one summary line on ``log`` at the end, saying
    how many bytes of the checkpoint this process read (its share, or none
    where the model-cache service gave the files). With ``early`` (the same
    files, one rank, no filter), the tensors come from that read, begun
    before: the summary says how far it had come."""
    group = process_group if config.collective else None
    started = time.perf_counter()
    bar = None
    if show_progress:
        try:
            from tqdm.auto import tqdm  # type: ignore[import-untyped,unused-ignore]

            bar = tqdm(
                desc="Loading safetensors using dmaload",
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                bar_format=bar_format,
                position=tqdm_position() if tqdm_position else None,
                mininterval=1.0,
            )
        except ImportError:
            bar = None

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    ranks, rank = 1, 0
    if group is not None:
        import torch.distributed as dist

        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    count = nbytes = 0
    early_note = ""
    unmapped = ""
    socket = socket_for(config.cache) if early is None else None
    if early is not None:
        early.stream.progress = progress if bar is not None else None
        stream: Stream | Mapped | None = early.stream
        unmapped = early.unmapped
        ahead = started - early.started
        early_note = (
            f"; the files were mapped {ahead:.2f} s before the engine asked for the first tensor (before the model "
            "was built)"
            if isinstance(early.stream, Mapped)
            else f"; the read began {ahead:.2f} s before the engine asked for the first tensor "
            f"(before the model was built) and had {early.stream.arrived() / 2**30:.3f} GiB in by then"
        )
    elif socket is None:
        mapped = Mapped.open(files, device, tensor_filter, plain=_plain(config, group))
        if isinstance(mapped, Mapped):
            stream = mapped
        else:
            unmapped = mapped
            stream = Stream(
                [Path(f) for f in files],
                None,
                device,
                process_group=group,
                tensor_filter=tensor_filter,
                window=config.window,
                progress=progress if bar is not None else None,
                # The engine copies each tensor into its parameter before it
                # asks for the next one.
                recycle=True,
                options=dict(config.options),
            )
    else:
        stream = None
    if stream is not None:
        tensors: Iterator[tuple[str, Any]] = iter(stream)
        planned = stream

        def reads() -> str:
            if isinstance(planned, Mapped):
                return planned.reads()
            note = f" (read, not mapped: {unmapped})" if unmapped else ""
            return f"{_stream_reads(planned, rank) / 2**30:.3f} GiB of the checkpoint{note}"

    else:
        # Each file whole from the service (read by it, not by this process),
        # or loaded here where the service could not serve it.
        opened = safe_open(list(files), "pt", device, cache=socket, tensor_filter=tensor_filter, **config.options)
        tensors = ((name, opened.get_tensor(name)) for name in opened.offset_keys())

        def reads() -> str:
            return _cache_reads(opened.reports)

    try:
        for name, tensor in tensors:
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor
        read = reads()  # before the files are closed: their reports go with them
    finally:
        if bar is not None:
            bar.close()
        if stream is None:
            opened.close()
    seconds = time.perf_counter() - started
    log.info(
        "dmaload: loaded %d tensors, %.3f GiB in %.2f s (%.2f GB/s, including the engine's work between "
        "tensors) on %s; %d rank(s) shared the reads, this process read %s%s",
        count,
        nbytes / 2**30,
        seconds,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        device,
        ranks,
        read,
        early_note,
    )


def _cache_reads(reports: Sequence[LoadReport]) -> str:
    """What this process read of a checkpoint the model-cache service was
    asked for: the files it loaded itself (those the service did not give)."""
    # A host buffer's destination is "cache-service (hit)", a device's
    # "cuda:N (...) via cache-service (hit)".
    served = [r for r in reports if "cache-service" in r.destination]
    read = sum(r.bytes for r in reports if "cache-service" not in r.destination)
    return f"{read / 2**30:.3f} GiB of the checkpoint ({len(served)} of {len(reports)} file(s) from the model-cache service)"
