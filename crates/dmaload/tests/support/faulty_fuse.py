"""A read-only FUSE filesystem with one file, `data`, whose reads fail with
EIO wherever they cover BAD_OFFSET: a real device-style I/O error for the
loader's error tests. Needs fusepy (pip) and libfuse2.

usage: faulty_fuse.py MOUNTPOINT SIZE BAD_OFFSET
"""

import errno
import stat
import sys

from fuse import FUSE, FuseOSError, Operations


class Faulty(Operations):
    def __init__(self, size: int, bad_offset: int) -> None:
        self.size = size
        self.bad_offset = bad_offset

    def getattr(self, path, fh=None):
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == "/data":
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": self.size}
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path, fh):
        return [".", "..", "data"]

    def read(self, path, size, offset, fh):
        if offset <= self.bad_offset < offset + size:
            raise FuseOSError(errno.EIO)
        end = min(offset + size, self.size)
        return bytes(max(0, end - offset))


if __name__ == "__main__":
    mountpoint, size, bad_offset = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    FUSE(Faulty(size, bad_offset), mountpoint, foreground=True, nothreads=True, ro=True)
