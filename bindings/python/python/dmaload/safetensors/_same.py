"""Whether the ranks of a group read the same bytes: fingerprints of the
files (or objects) each rank opened, and the digests their sums files
record, exchanged before any byte is read (see :mod:`._collective`)."""

from __future__ import annotations

import errno as errno_codes
import hashlib
import os
from collections.abc import Callable
from typing import Any

from ._group import CollectiveLoadError, Source, _collective, _Group


def _boot() -> int:
    """This kernel's boot (``/proc/sys/kernel/random/boot_id``; a random
    number where it cannot be read, which matches no other rank's): two
    ranks that see the same (device, inode) see one file only inside one
    kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read()
    except OSError:
        boot = os.urandom(16)
    return int.from_bytes(hashlib.blake2b(boot, digest_size=7).digest(), "little")


_HOST = _boot()


def _identity(fds: list[int]) -> int:
    """A fingerprint of the open files: device, inode, size, modification
    and change times (nanoseconds). Equal on ranks of one host that opened
    the same files, unchanged."""
    h = hashlib.blake2b(digest_size=7)
    for fd in fds:
        st = os.fstat(fd)
        h.update(f"{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0".encode())
    return int.from_bytes(h.digest(), "little")


def _object_identity(identities: list[str | None]) -> int:
    """A fingerprint of the objects a loader looked up (URL, ETag and size
    each): equal on ranks anywhere that read the same object versions."""
    h = hashlib.blake2b(digest_size=7)
    for identity in identities:
        h.update(f"{identity}\0".encode())
    return int.from_bytes(h.digest(), "little")


def _other_objects(group: _Group, where: str, urls: list[Source], identities: list[str | None]) -> CollectiveLoadError:
    """The error every rank raises where the ranks' objects differ (their
    fingerprints in the plan did): a second exchange, of each object's URL
    and identity, names the first object that differs (the same one on
    every rank), and whether a rank was handed another URL there (another
    checkpoint: loading again would not help) or sees another version
    under the same URL (replaced between the ranks' lookups, or mirrors
    that differ)."""
    mine = [_object_identity([text]) for url, identity in zip(urls, identities) for text in (os.fspath(url), identity)]
    rows = _collective(group, f"comparing the objects of {where}", group.gather_ints, mine)
    for i, url in enumerate(urls):
        for r, row in enumerate(rows):
            if row[2 * i] != rows[0][2 * i]:
                return CollectiveLoadError(
                    f"rank {group.rank}: rank {r} was handed another object than rank 0 where this rank reads {url}: "
                    "the ranks were given different checkpoints; give every rank the same model"
                )
            if row[2 * i + 1] != rows[0][2 * i + 1]:
                return CollectiveLoadError(
                    f"rank {group.rank}: rank {r} sees another version (ETag or size) of {url} than rank 0: it was "
                    "replaced while the ranks looked it up (load again), or the ranks read mirrors that hold "
                    "different checkpoints"
                )
    return CollectiveLoadError(f"rank {group.rank}: the ranks see different objects or versions of {where}")


_SUMS_KINDS = {"B3SUMS": 1, "SHA256SUMS": 2}


def _same_bytes(group: _Group, where: str, paths: list[Source], digest_of: Callable[[int], Any], same_file: bool) -> list[Any]:
    """The ranks' proof that they read the same bytes, where they do not
    all open the same files on one host (``same_file``) or verification
    was asked: every rank's sums files list every file, and record the same
    digest on every rank (so a stale copy beside its own stale sums fails
    here, before any byte is read); each rank then hashes the whole stream
    of every file it is handed (see :class:`_Verify`). Raises
    CollectiveLoadError on every rank otherwise, saying how to make the
    load safe."""
    rank = group.rank
    digests: list[Any] = []
    failure: OSError | None = None
    mine: list[int] = []
    for i, p in enumerate(paths):
        try:
            d = digest_of(i)
        except OSError as exc:
            failure = failure or exc
            mine += [exc.errno or errno_codes.EINVAL, 0, 0, 0, 0, 0]
            continue
        digests.append(d)
        raw = bytes.fromhex(d.expected)
        mine += [0, _SUMS_KINDS[d.sums_file]] + [int.from_bytes(raw[k : k + 8], "little", signed=True) for k in range(0, 32, 8)]
    rows = _collective(group, f"agreeing on the digests of {where}", group.gather_ints, mine)
    why = "" if same_file else "the ranks do not all open the same files on one host, so "
    for r, row in enumerate(rows):
        for i, p in enumerate(paths):
            entry, first = row[6 * i : 6 * i + 6], rows[0][6 * i : 6 * i + 6]
            if entry[0]:
                cause = f" ({failure})" if r == rank and failure is not None else ""
                if isinstance(p, str):
                    how = f"upload a B3SUMS or SHA256SUMS listing it beside {p} (`dmaload sums` writes one)"
                else:
                    how = (
                        f"run `dmaload sums {p.parent}` where the checkpoint was written and copy the sums "
                        "file with it to every node, or load one copy shared by all ranks on one host"
                    )
                raise CollectiveLoadError(
                    f"rank {rank}: {why}every rank needs a B3SUMS or SHA256SUMS beside each file listing it, "
                    f"and rank {r} has none for {p}{cause}: {how}"
                ) from failure
            if entry != first:
                raise CollectiveLoadError(
                    f"rank {rank}: rank {r}'s sums file records another digest for {p} than rank 0's: "
                    "the ranks hold different checkpoints (a stale or re-downloaded copy); make every "
                    "node's copy the same, with its sums file"
                )
    return digests
