"""A read-only FUSE filesystem with one file, `data`, of SIZE bytes (the
byte at offset N is N % 251, so a load is checked byte for byte),
that serves O_DIRECT reads at DIRECT_MBPS and buffered ones at
BUFFERED_MBPS (megabytes per second, each a budget shared by that mode's
reads in flight): an emulated disk on which one read mode is the faster,
for the loader's read-mode choice. The mode of each read is the file's
flags at the time of the read, which FUSE hands the server with every
READ request. Needs fusepy (pip) and libfuse2.

usage: rated_fuse.py MOUNTPOINT SIZE DIRECT_MBPS BUFFERED_MBPS
"""

import errno
import os
import stat
import sys
import threading
import time

from fuse import FUSE, FuseOSError, Operations


CYCLE = 251
# Enough cycles for the reads FUSE hands the server (128 KiB to 1 MiB) from any offset.
PATTERN = bytes(range(CYCLE)) * ((2 << 20) // CYCLE + 2)


class Rated(Operations):
    def __init__(self, size: int, direct: float, buffered: float) -> None:
        self.size = size
        self.rate = {True: direct * 1e6, False: buffered * 1e6}
        # When each mode's budget is next free (time.monotonic).
        self.free_at = {True: 0.0, False: 0.0}
        self.budget_lock = threading.Lock()

    def getattr(self, path, fh=None):
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == "/data":
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": self.size, "st_blksize": 4096}
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path, fh):
        return [".", "..", "data"]

    def open(self, path, fi):
        return 0

    def read(self, path, size, offset, fi):
        direct = bool(fi.flags & os.O_DIRECT)
        end = min(offset + size, self.size)
        with self.budget_lock:
            now = time.monotonic()
            done = max(now, self.free_at[direct]) + max(0, end - offset) / self.rate[direct]
            self.free_at[direct] = done
        time.sleep(max(0.0, done - time.monotonic()))
        start, n = offset % CYCLE, max(0, end - offset)
        pattern = PATTERN if start + n <= len(PATTERN) else bytes(range(CYCLE)) * (n // CYCLE + 2)
        return pattern[start : start + n]


if __name__ == "__main__":
    mountpoint, size, direct, buffered = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    FUSE(Rated(size, direct, buffered), mountpoint, foreground=True, ro=True, raw_fi=True)
