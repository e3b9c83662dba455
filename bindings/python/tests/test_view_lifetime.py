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

a, b, offset, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
N = 65536
expected = open(a, "rb").read()[offset:offset + N]
if mode == "with":
    try:
        with dmaload.load(a) as buf:
            {setup}
    except BufferError:
        pass             # leaving the with closes: refused while an export lives
else:
    buf = dmaload.load(a)
    {setup}
    try:
        buf.close()      # refused while an export lives; fine either way
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


@pytest.mark.parametrize("mode", ["close", "with"])
@pytest.mark.parametrize("name", sorted(VIEWS))
def test_a_view_keeps_the_memory_after_close_and_del(name: str, mode: str, two_files: tuple[Path, Path]) -> None:
    """mode "close": close() then del; mode "with": the view outlives the
    with block, then del."""
    setup, read = VIEWS[name]
    offset = 4096 if "slice" in name else 0
    code = textwrap.dedent(CHILD).format(setup=setup, read=read)
    a, b = two_files
    out = subprocess.run(
        [sys.executable, "-c", code, str(a), str(b), str(offset), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "VIEW-OK" in out.stdout, (
        f"{name}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    )


SAFETENSORS_CHILD = """
import gc, sys
import numpy as np
import dmaload
from dmaload.safetensors import safe_open
import dmaload.safetensors.numpy as dnp
import dmaload.safetensors.torch as dpt
from safetensors.numpy import load_file as reference

a, b, how = sys.argv[1], sys.argv[2], sys.argv[3]
expected = reference(a)["w"]
if how == "numpy load_file":
    t = dnp.load_file(a)["w"]
elif how == "torch load_file":
    t = dpt.load_file(a)["w"]
else:
    framework = "pt" if "torch" in how else "np"
    with safe_open(a, framework=framework) as f:
        t = f.get_tensor("w")
        buffers = f.buffers
    for buf in buffers:           # the loader's own buffer: try to close it
        try:
            buf.close()
        except BufferError:
            pass
    del buffers, buf, f
gc.collect()
others = [dmaload.load(b) for _ in range(4)]   # reuse freed addresses if any
got = t.numpy() if hasattr(t, "numpy") else t
assert np.array_equal(got, expected), "the tensor no longer holds the first file's values"
before = [bytes(memoryview(o)) for o in others]
t[:16] = 0
after = [bytes(memoryview(o)) for o in others]
assert before == after, "writing through the tensor changed another buffer"
print("TENSOR-OK")
"""


@pytest.mark.parametrize("how", ["numpy load_file", "torch load_file", "numpy safe_open", "torch safe_open"])
def test_safetensors_tensors_keep_their_memory(how: str, tmp_path: Path) -> None:
    """A tensor from dmaload.safetensors outlives the loader, safe_open's
    with block and an attempt to close the loader's buffer, then still holds
    its values after other loads of the same size."""
    np = pytest.importorskip("numpy")
    st_numpy = pytest.importorskip("safetensors.numpy")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.bin"
    st_numpy.save_file({"w": np.random.default_rng(3).standard_normal(300_000).astype(np.float32)}, a)
    write_random(b, a.stat().st_size, seed=4)
    out = subprocess.run(
        [sys.executable, "-c", SAFETENSORS_CHILD, str(a), str(b), how], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "TENSOR-OK" in out.stdout, f"{how}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"


RELEASE_CHILD = """
import gc, os, sys, weakref
import numpy as np
import torch
import dmaload

def mapped() -> int:
    return sum("memfd:dmaload" in line for line in open("/proc/self/maps"))

def fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:dmaload")
        except OSError:
            pass
    return n

base = (mapped(), fds())
try:
    with dmaload.load(sys.argv[1]) as buf:
        view = {make}
except BufferError:
    pass  # leaving the with closes: refused while an export lives
alive = weakref.ref(buf)
del buf
gc.collect()
assert alive() is not None and mapped() > base[0], "unmapped while a view still reaches it"
del view
gc.collect()
assert alive() is None, "the Buffer outlived its last view"
assert (mapped(), fds()) == base, f"still mapped or open after the last view went: {(mapped(), fds())} vs {base}"
print("RELEASED")
"""

MAKERS = {
    "torch frombuffer": "torch.frombuffer(buf, dtype=torch.uint8)[10:]",
    "torch from_dlpack": "torch.from_dlpack(buf)",
    "numpy frombuffer": "np.frombuffer(buf, dtype=np.uint8)[10:]",
    "numpy from_dlpack": "np.from_dlpack(buf)",
    "memoryview": "memoryview(buf)[10:]",
}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_the_memory_and_memfd_are_released_when_the_last_view_goes(name: str, two_files: tuple[Path, Path]) -> None:
    """The other half of the rule: no leak. Once the Buffer and every view
    are gone, the mapping is gone from /proc/self/maps and the memfd from
    /proc/self/fd, and a weak reference to the Buffer is dead."""
    a, _ = two_files
    code = RELEASE_CHILD.replace("{make}", MAKERS[name])
    out = subprocess.run([sys.executable, "-c", code, str(a)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "RELEASED" in out.stdout, f"{name}: {out.stdout}\n{out.stderr}"


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
