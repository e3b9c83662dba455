"""A read-only FUSE filesystem with one file, `data`, whose reads fail with
EIO wherever they cover BAD_OFFSET: a real device-style I/O error for the
loader's error tests. With MODE `hang`, such a read never answers instead
(a server that went silent): the server prints HANGING and blocks. Needs
fusepy (pip) and libfuse2. BLKSIZE (default 4096) is the file's st_blksize:
FUSE reports no STATX_DIOALIGN, so it is the direct-I/O alignment a loader
falls back to. The file's bytes are zeros, after the bytes of the file
PREFIX where one is named (a safetensors header, say).

usage: faulty_fuse.py MOUNTPOINT SIZE BAD_OFFSET [BLKSIZE [MODE [PREFIX]]]
"""

import errno
import stat
import sys
import threading

from fuse import FUSE, FuseOSError, Operations


class Faulty(Operations):
    def __init__(self, size: int, bad_offset: int, blksize: int, hang: bool, prefix: bytes) -> None:
        self.size = size
        self.prefix = prefix
        self.bad_offset = bad_offset
        self.blksize = blksize
        self.hang = hang

    def getattr(self, path, fh=None):
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == "/data":
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": self.size,
                    "st_blksize": self.blksize}
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path, fh):
        return [".", "..", "data"]

    def read(self, path, size, offset, fh):
        if offset <= self.bad_offset < offset + size:
            if self.hang:
                print("HANGING", flush=True)
                threading.Event().wait()
            raise FuseOSError(errno.EIO)
        end = min(offset + size, self.size)
        head = self.prefix[offset:end]
        return head + bytes(max(0, end - offset - len(head)))


if __name__ == "__main__":
    mountpoint, size, bad_offset = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    blksize = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
    hang = len(sys.argv) > 5 and sys.argv[5] == "hang"
    prefix = open(sys.argv[6], "rb").read() if len(sys.argv) > 6 else b""
    FUSE(Faulty(size, bad_offset, blksize, hang, prefix), mountpoint, foreground=True, nothreads=True, ro=True)
