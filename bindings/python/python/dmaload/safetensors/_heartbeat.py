"""The heartbeat of a group load: how a rank learns, within a bounded
time, that a peer died, stopped or was cut off mid-load, whatever the
collective backend (see ``_collective``'s module docs)."""

from __future__ import annotations

import threading
import time
from typing import Any

DEAD_AFTER = 30.0
"""Seconds without a heartbeat from a peer rank after which the others
take it as gone (dead, stopped, cut off) and fail the load: the bound on
how long a rank that dies mid-load can hold the others, whatever the
backend (one that notices sooner, as gloo does for a closed connection,
fails them sooner). A live rank beats from a thread of its own, so a slow
consumer, or a rank reading a large share, is not taken as gone."""

_BEAT_S = 1.0
"""Seconds between heartbeats."""

_POLL_S = 0.1
"""Seconds between looks at the heartbeat while a collective waits."""

_LEFT = -(1 << 40)
"""Added to a rank's heartbeat count when it leaves a load unfinished."""

def _store(dist: Any) -> Any:
    """The default group's key-value store (every rendezvous has one), or
    None where this torch does not say (the backend's own failure
    detection and the group's timeout are then the only bounds)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


class _Heartbeat:
    """A rank's heartbeat during a group load: a thread adds 1 to this
    rank's count in the group's store every ``_BEAT_S`` seconds and reads
    the others' counts; ``gone`` says why the load cannot go on once a
    peer's count has not moved for ``DEAD_AFTER`` seconds, a peer left
    the load, or the store stops answering (it lives in rank 0 with a TCP
    rendezvous: rank 0 died)."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int) -> None:
        self._store, self._prefix, self._rank, self._size = store, prefix, rank, size
        self.gone: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dmaload-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def _run(self) -> None:
        seen = {r: (0, time.monotonic()) for r in range(self._size) if r != self._rank}
        while not self._stopped.is_set():
            try:
                self._store.add(self._key(self._rank), 1)
                now = time.monotonic()
                for r, (count, since) in seen.items():
                    theirs = self._store.add(self._key(r), 0)
                    if theirs < 0:
                        self.gone = f"rank {r} left the load"
                    elif theirs != count:
                        seen[r] = (theirs, now)
                    elif now - since > DEAD_AFTER:
                        self.gone = f"rank {r} sent no heartbeat for {DEAD_AFTER:.0f} s (dead, stopped or cut off)"
            except Exception as exc:  # the store's failure: rank 0 (its server) is gone
                self.gone = f"the group's store stopped answering ({exc})"
            if self.gone is not None:
                return
            self._stopped.wait(_BEAT_S)

    def stop(self, finished: bool) -> None:
        self._stopped.set()
        if not finished:
            try:
                self._store.add(self._key(self._rank), _LEFT)
            except Exception:  # the store is gone: the others see that
                pass
