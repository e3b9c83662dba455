"""``dmaload.load_dmabuf``: a file in a new dma-buf, as a DmaBuf owning its fd.

The loads run where the kernel has udmabuf or a dma-heap (the QEMU guest of
tests/vm runs the same paths from Rust and C); everywhere, what they refuse."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import dmaload

HAVE = {
    "udmabuf": os.path.exists("/dev/udmabuf"),
    "dma-heap:system": os.path.exists("/dev/dma_heap/system"),
}
HAVE["dmabuf"] = any(HAVE.values())


@pytest.mark.parametrize("to", ["udmabuf", "dma-heap:system", "dmabuf"])
def test_a_dmabuf_holds_the_range_or_the_kernel_says_why_not(data_file: tuple[Path, bytes], to: str) -> None:
    path, data = data_file
    if not HAVE[to]:
        with pytest.raises(OSError) as e:
            dmaload.load_dmabuf(path, 5000, 70000, to=to)
        assert e.value.errno == errno.EINVAL and "does not exist" in str(e.value)
        pytest.skip(f"{to}: no such device here")
    with dmaload.load_dmabuf(path, 5000, 70000, to=to) as buf:
        assert len(buf) == 70000 and buf.data_offset + len(buf) <= buf.size
        assert buf.tobytes() == data[5000:75000]
        # The fd is the dma-buf itself (the kernel sizes its inode so).
        assert os.fstat(buf.fileno()).st_size == buf.size and buf.report.bytes == 70000
    assert buf.closed
    with pytest.raises(ValueError, match="closed"):
        buf.fileno()
    owned = dmaload.load_dmabuf(path, to=to)
    fd = owned.detach()
    assert owned.closed and os.fstat(fd).st_size in (0, owned.size)
    os.close(fd)


def test_an_unknown_heap_names_its_path(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    with pytest.raises(OSError) as e:
        dmaload.load_dmabuf(path, to="dma-heap:no-such-heap")
    assert e.value.errno == errno.EINVAL
    assert e.value.filename == "/dev/dma_heap/no-such-heap"


def test_what_is_not_a_dmabuf_is_refused(data_file: tuple[Path, bytes], tmp_path: Path) -> None:
    path, _ = data_file
    with pytest.raises(ValueError, match="not a dma-buf"):
        dmaload.load_dmabuf(path, to="memfd")
    with pytest.raises(ValueError, match="unknown destination"):
        dmaload.load_dmabuf(path, to="vram")
    with pytest.raises(FileNotFoundError):
        dmaload.load_dmabuf(tmp_path / "missing")
    with pytest.raises(OSError) as e:
        dmaload.load_dmabuf(path, 0, 4 << 20)
    assert e.value.errno == errno.ENODATA
    # dmaload.load keeps to host memory, and says where a dma-buf comes from.
    with pytest.raises(OSError) as e:
        dmaload.load(path, to="udmabuf")  # type: ignore[arg-type]
    assert e.value.errno == errno.EINVAL and "load_dmabuf" in str(e.value)
