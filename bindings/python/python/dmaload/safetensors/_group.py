"""The process group a collective stream is loaded by: its rank and size,
its collectives bounded by the heartbeat, and the error every rank raises
when one of them fails (see :mod:`._collective`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias, Union

from ._heartbeat import _POLL_S, _Heartbeat, _store

Source: TypeAlias = Union[Path, str]
"""A stream's file: a path, or an object's ``s3://BUCKET/KEY`` URL."""


class CollectiveLoadError(RuntimeError):
    """A load shared by a process group failed on some rank: the message
    names that rank (or says a peer left), the file and the byte range."""


class _Group:
    """The torch.distributed side: rank, size, the device collectives run
    on, and (once :meth:`watch` started it) the heartbeat that bounds each
    wait for the others."""

    def __init__(self, group: Any) -> None:
        import torch
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self.name = str(getattr(group, "group_name", "") or "default")
        self.heartbeat: _Heartbeat | None = None

    def watch(self, load: int) -> None:
        """Starts this rank's heartbeat for the group's load number ``load``
        (agreed in the plan): from here on, a wait for the others ends
        within ``DEAD_AFTER`` seconds of a peer going silent."""
        store = _store(self.dist)
        if store is not None:
            self.heartbeat = _Heartbeat(store, f"dmaload/{self.name}/{load}", self.rank, self.size)

    def _wait(self, work: Any) -> None:
        """Waits for ``work`` (an async collective), raising once the
        heartbeat says a peer is gone rather than waiting for the backend
        to notice (a gloo send to a stopped peer waits for the group's
        timeout, 30 minutes by default); then raises its own failure."""
        if self.heartbeat is not None:
            done = threading.Event()
            work.get_future().add_done_callback(lambda _future: done.set())
            while not done.wait(_POLL_S):
                gone = self.heartbeat.gone
                if gone is not None:
                    raise RuntimeError(gone)
        work.wait()

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on all ranks)."""
        import torch

        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.size * len(values), dtype=torch.int64, device=self.device)
        self._wait(self.dist.all_gather_into_tensor(out, mine, group=self.group, async_op=True))
        rows: list[list[int]] = out.view(self.size, len(values)).tolist()
        return rows

    def gather_slots(self, buffer: Any, slot: int) -> None:
        """Fills ``buffer`` (N slots) with every rank's slot, in place."""
        mine = buffer[self.rank * slot : (self.rank + 1) * slot]
        self._wait(self.dist.all_gather_into_tensor(buffer, mine, group=self.group, async_op=True))

    def leave(self, finished: bool) -> None:
        """Stops the heartbeat; a rank leaving before the end of the load
        says so at once, so the others need not wait ``DEAD_AFTER``."""
        if self.heartbeat is not None:
            self.heartbeat.stop(finished)
            self.heartbeat = None


def _collective(group: _Group, doing: str, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, a collective of ``group``, its failure (the backend's
    error for a dead, failed or silent peer) raised as a CollectiveLoadError
    saying what this rank was ``doing``."""
    try:
        return call(*args)
    except Exception as exc:
        raise CollectiveLoadError(
            f"rank {group.rank}: a peer rank failed or left while {doing}: {exc}"
        ) from exc
