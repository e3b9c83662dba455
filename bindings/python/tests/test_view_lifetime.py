"""A buffer's memory is never unmapped while anything can still reach it.

Each case runs in a child process, so a use after free (a segfault, or
silently reading another buffer's bytes) fails the test instead of killing
pytest. The child loads file A, makes a view in one of the ways users do,
closes and drops the buffer, loads file B of the same size (which would
reuse the freed address), then checks that the view still reads A's bytes
and that writing through it leaves B alone.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import write_random

SIZE = (2 << 20) + 4096 * 3

# name -> (setup code making `view` from `buf`, code reading view[:n] as bytes)
VIEWS = {
    "memoryview": ("view = memoryview(buf)", "bytes(view[:N])"),
    "memoryview slice": ("view = memoryview(buf)[4096:]", "bytes(view[:N])"),
    "numpy frombuffer": ("view = np.frombuffer(buf, dtype=np.uint8)", "view[:N].tobytes()"),
    "numpy slice": ("view = np.frombuffer(buf, dtype=np.uint8)[4096:]", "view[:N].tobytes()"),
    "numpy asarray": ("view = np.asarray(memoryview(buf))", "view[:N].tobytes()"),
    "numpy from_dlpack": ("view = np.from_dlpack(buf)", "view[:N].tobytes()"),
    "torch frombuffer": ("view = torch.frombuffer(buf, dtype=torch.uint8)", "view[:N].numpy().tobytes()"),
    "torch frombuffer slice": (
        "view = torch.frombuffer(buf, dtype=torch.uint8)[4096:]",
        "view[:N].numpy().tobytes()",
    ),
    "torch from_dlpack": ("view = torch.from_dlpack(buf)", "view[:N].numpy().tobytes()"),
}

CHILD = """
import gc, sys
import numpy as np
import torch
import dmaload

a, b, offset = sys.argv[1], sys.argv[2], int(sys.argv[3])
N = 65536
expected = open(a, "rb").read()[offset:offset + N]
buf = dmaload.load(a)
{setup}
try:
    buf.close()          # refused while an export lives; fine either way
except BufferError:
    pass
del buf
gc.collect()
others = [dmaload.load(b) for _ in range(4)]   # reuse freed addresses if any
got = {read}
assert got == expected, "the view no longer reads the first file's bytes"
before = [bytes(memoryview(o)[:N]) for o in others]
try:
    if isinstance(view, memoryview):
        view[:16] = bytes(16)
    else:
        view[:16] = 0
except (ValueError, TypeError, RuntimeError):
    pass  # a read-only view: reading was the test
after = [bytes(memoryview(o)[:N]) for o in others]
assert before == after, "writing through the stale view changed another buffer"
print("VIEW-OK")
"""


@pytest.fixture(scope="module")
def two_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("lifetime")
    a, b = d / "a.bin", d / "b.bin"
    write_random(a, SIZE, seed=11)
    write_random(b, SIZE, seed=12)
    return a, b


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_a_view_keeps_the_memory_after_close_and_del(name: str, two_files: tuple[Path, Path]) -> None:
    setup, read = VIEWS[name]
    offset = 4096 if "slice" in name else 0
    code = textwrap.dedent(CHILD).format(setup=setup, read=read)
    a, b = two_files
    out = subprocess.run(
        [sys.executable, "-c", code, str(a), str(b), str(offset)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "VIEW-OK" in out.stdout, (
        f"{name}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    )


def test_the_memory_is_released_when_the_last_view_goes(two_files: tuple[Path, Path]) -> None:
    a, _ = two_files
    code = textwrap.dedent(
        """
        import gc, sys
        import torch
        import dmaload

        def mapped() -> int:
            return sum("memfd:dmaload" in line for line in open("/proc/self/maps"))

        base = mapped()
        with dmaload.load(sys.argv[1]) as buf:
            view = torch.frombuffer(buf, dtype=torch.uint8)
        del buf
        gc.collect()
        assert mapped() > base, "unmapped while a tensor still reaches it"
        del view
        gc.collect()
        assert mapped() == base, "still mapped after the last view went"
        print("RELEASED")
        """
    )
    out = subprocess.run([sys.executable, "-c", code, str(a)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "RELEASED" in out.stdout, f"{out.stdout}\n{out.stderr}"
