"""What the bench scripts share, written once: size parsing, the one
generated model (an LLM-shaped safetensors file, written without torch),
page-cache state (resident bytes, eviction, warming) and progress lines.

bench/gpu.py, gpu_core.py, gpu_register.py and peers.py import it; run
them from anywhere (each puts bench/ on ``sys.path``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
ROOT = Path(__file__).resolve().parent.parent

def log(msg: str) -> None:
    """A progress line on stderr, flushed at once."""
    print(msg, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """``8G``, ``256M``, ``1.5G``, ``4GiB``, ``65536``: bytes (powers of 1024)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 8G, 256M)")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)])



# --------------------------------------------------------------------------
# The model: an LLM-shaped safetensors file, written without torch

# (name, hidden, intermediate, vocab, kv width): Llama-like shapes, the
# largest whose embeddings and lm_head take at most half of the size is used.
CONFIGS = [
    ("llama-3-8b", 4096, 14336, 128256, 1024),
    ("tinyllama", 2048, 5632, 32000, 256),
    ("mini", 1024, 2816, 32000, 256),
    ("micro", 256, 704, 8000, 64),
]


def model_layout(size: int) -> tuple[str, list[tuple[str, list[int]]]]:
    """(config name, [(tensor name, shape)]) of a bf16 model of about ``size`` bytes."""
    for cfg in CONFIGS:
        name, hidden, inter, vocab, kv = cfg
        fixed = 2 * (2 * vocab * hidden + hidden)
        if fixed <= 0.5 * size or cfg is CONFIGS[-1]:
            break
    per_layer = 2 * (2 * hidden * hidden + 2 * kv * hidden + 3 * inter * hidden + 2 * hidden)
    layers = max(1, round((size - fixed) / per_layer))
    out: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", [hidden]),
            (p + "self_attn.q_proj.weight", [hidden, hidden]),
            (p + "self_attn.k_proj.weight", [kv, hidden]),
            (p + "self_attn.v_proj.weight", [kv, hidden]),
            (p + "self_attn.o_proj.weight", [hidden, hidden]),
            (p + "post_attention_layernorm.weight", [hidden]),
            (p + "mlp.gate_proj.weight", [inter, hidden]),
            (p + "mlp.up_proj.weight", [inter, hidden]),
            (p + "mlp.down_proj.weight", [hidden, inter]),
        ]
    out += [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]
    return f"{name}, {layers} layers", out


def write_model(path: Path, size: int, dtype: str = "BF16") -> tuple[str, int]:
    """Writes the model: the safetensors format itself (u64 LE header length,
    JSON header padded with spaces to 8 bytes, data in name order), filled
    with one random 64 MiB block rotated by a different amount per tensor
    and per block, so no two pages are alike. ``dtype``: a 2-byte dtype,
    BF16 (the GPU rows) or F16 (NumPy has no bfloat16: peers.py's NumPy
    rows). Returns (config, tensors)."""
    assert dtype in ("BF16", "F16"), dtype
    config, layout = model_layout(size)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "generator": "dmaload bench/_common.py"}}
    offset = 0
    sizes = []
    for name, shape in sorted(layout):
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        sizes.append(n)
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    block = memoryview(os.urandom(64 * MIB))
    tmp = path.with_name(path.name + ".partial")
    k = 0
    with open(tmp, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for n in sizes:
            left = n
            while left:
                k += 1
                r = (k * 4099 + 1) % len(block)  # not a multiple of a page
                for piece in (block[r:], block[:r]):
                    take = min(left, len(piece))
                    if take:
                        f.write(piece[:take])
                        left -= take
        os.fsync(f.fileno())
    tmp.rename(path)
    return config, len(layout)


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(tensor entries, data section start) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


# --------------------------------------------------------------------------
# Page cache

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(path: Path) -> int:
    """Bytes of the file in the page cache (mincore over a mapping that reads nothing)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed", str(path))
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", str(path))
            odd = bytes((i & 1) for i in range(256))  # bit 0: resident; the others are reserved
            return min(size, bytes(vec).translate(odd).count(1) * PAGE)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def evict(path: Path, cli: str | None = None) -> None:
    """Drops the file from the page cache (``dmaload evict`` with the native
    ``cli`` where given, for scripts that run without the Python package,
    else dmaload.evict: the core's either way) and, as root, all clean caches."""
    if cli is not None:
        subprocess.run([cli, "evict", str(path)], check=True, capture_output=True)
    else:
        import dmaload  # here, not at the top: the cli= callers run without the package

        dmaload.evict(path)
    if os.geteuid() == 0:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
        except OSError:
            pass


def warm(path: Path) -> None:
    """Reads the whole file through the page cache (unless it is all there)."""
    size = path.stat().st_size
    if resident_bytes(path) >= size:
        return
    buf = bytearray(16 * MIB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def bench_cli() -> str | None:
    """Path of the ``dmaload-bench`` command (the benchmarks' binary, built
    beside ``dmaload`` by ``cargo build --release -p dmaload-bench``):
    ``$DMALOAD_BENCH``, else the one beside ``$DMALOAD_CLI`` (bench/gpu-kit.sh
    sets it), on ``PATH``, or in this checkout's target/release; None where
    there is none."""
    beside_cli = os.environ.get("DMALOAD_CLI")
    candidates = [
        os.environ.get("DMALOAD_BENCH"),
        str(Path(beside_cli).with_name("dmaload-bench")) if beside_cli else None,
        shutil.which("dmaload-bench"),
        str(ROOT / "target" / "release" / "dmaload-bench"),
    ]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)
