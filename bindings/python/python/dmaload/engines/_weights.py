"""What the engine loaders share: their options and the weights iterator."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._cache import Cache, socket_for
from .._options import LoadOptions, native_options, parse_size
from ..safetensors import TensorFilter, iter_tensors
from ..safetensors._collective import Stream

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
class LoaderConfig:
    """The loader's options, from an engine's extra config."""

    window: int | None = None
    collective: bool = True
    cache: Cache = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def take(cls, extra: dict[str, Any]) -> LoaderConfig:
        """The options among ``extra``, removed from it (the rest is the
        engine's own); a bad value is a ``ValueError`` naming the key."""
        mine = {k: extra.pop(k) for k in list(extra) if k in EXTRA_CONFIG_KEYS}
        window = mine.pop("window", None)
        if window is not None:
            window = parse_size(window)
            if window < 1:
                raise ValueError(f"dmaload: window must be at least 1 byte, not {window}")
        collective = mine.pop("collective", True)
        if not isinstance(collective, bool):
            raise ValueError(f"dmaload: collective must be true or false, not {collective!r}")
        cache = mine.pop("cache", None)
        if cache is not None and not isinstance(cache, (bool, str)):
            raise ValueError(f"dmaload: cache must be true, false or a socket path, not {cache!r}")
        try:
            native_options(mine)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"dmaload: {exc}") from None
        return cls(window, collective, cache, mine)


def world_device_group(get_world_group: Callable[[], Any]) -> Any:
    """An engine's world device group (its ``get_world_group()``) when there
    are several ranks, else None; None too where no world group exists (a
    loader used outside an engine)."""
    try:
        world = get_world_group()
    except AssertionError:
        return None
    return world.device_group if world.world_size > 1 else None


def storage_read_bytes() -> int | None:
    """This process's bytes read from storage so far (``/proc/self/io``
    ``read_bytes``), or None where the kernel does not count them."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


@dataclass
class EarlyRead:
    """A read of an engine's checkpoint begun before the engine asks for
    the weights (:func:`start_early`), which :func:`weights` takes over."""

    stream: Stream
    started: float
    """``time.perf_counter()`` when it began."""
    read_before: int | None
    """This process's storage reads then (:func:`storage_read_bytes`)."""
    taken: bool = False
    """Whether :func:`weights` has taken it over (once only)."""

    @property
    def paths(self) -> list[Path]:
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
    read_before = storage_read_bytes()
    started = time.perf_counter()
    stream = Stream(
        [Path(f) for f in files], None, device, window=config.window, recycle=True, options=dict(config.options)
    )
    try:
        stream.start()
    except BaseException:
        stream.close()
        raise
    return EarlyRead(stream, started, read_before)


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
    ``show_progress``, and one summary line on ``log`` at the end. With
    ``early`` (the same files, one rank, no filter), the tensors come from
    that read, begun before: the summary says how far it had come."""
    group = process_group if config.collective else None
    started = time.perf_counter()
    read_before = storage_read_bytes() if early is None else early.read_before
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

    count = nbytes = 0
    early_note = ""
    if early is not None:
        early.stream.progress = progress if bar is not None else None
        tensors: Iterator[tuple[str, Any]] = iter(early.stream)
        early_note = (
            f"; the read began {started - early.started:.2f} s before the engine asked for the first tensor "
            f"(before the model was built) and had {early.stream.arrived() / 2**30:.3f} GiB in by then"
        )
    else:
        tensors = iter_tensors(
            list(files),
            device,
            process_group=group,
            tensor_filter=tensor_filter,
            window=config.window,
            progress=progress if bar is not None else None,
            cache=config.cache,
            # The engine copies each tensor into its parameter before it
            # asks for the next one.
            recycle=True,
            **config.options,
        )
    try:
        for name, tensor in tensors:
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - started
    read_after = storage_read_bytes()
    ranks = 1
    if group is not None:
        import torch.distributed as dist

        ranks = dist.get_world_size(group)
    read = f"{(read_after - read_before) / 2**30:.3f} GiB" if read_before is not None and read_after is not None else "n/a"
    log.info(
        "dmaload: loaded %d tensors, %.3f GiB in %.2f s (%.2f GB/s, including the engine's work between "
        "tensors) on %s; %d rank(s) shared the reads, this process read %s from storage%s",
        count,
        nbytes / 2**30,
        seconds,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        device,
        ranks,
        read,
        early_note,
    )

