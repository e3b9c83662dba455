#!/usr/bin/env python3
"""GPU load benchmark: safetensors straight into GPU memory, dmaload against its peers.

One generated LLM-shaped safetensors file (bf16, Llama-like names and
shapes, the number of layers scaled to reach ``--size``), loaded onto the GPU
by every loader, each run in a fresh process, the loaders interleaved round
by round, from a cold and from a warm page cache:

  dmaload                dmaload.safetensors.torch.load_file(path, device=DEV)
  dmaload-cache          the same with cache=: a `dmaload serve` (--cli)
                         started for the run and given the file once, so
                         the children copy from the service's memory
  safetensors            safetensors.torch.load_file(path, device=DEV)
  fastsafetensors        SafeTensorsFileLoader(SingleGroup(), DEV, nogds=True)
                         + add_filenames + copy_files_to_device + get_tensor
  fastsafetensors (GDS)  the same with nogds=False; reported as "GDS
                         unavailable: ..." where GDS does not load (no
                         /dev/nvidia-fs0, no libcufile, or fastsafetensors
                         fell back to its nogds copier)
  runai-model-streamer   SafetensorsStreamer().stream_file(path, device=DEV)
                         + get_tensors
  raw O_DIRECT (ceiling) the file read with O_DIRECT into 16 reused 16 MiB
                         buffers by 16 threads: no allocation, nothing
                         copied to the GPU; the disk's speed from Python
  H2D                    1 GiB host->device copies, pinned and pageable,
                         best of 5: the bus ceiling (no cache state)

Cold: before the child starts the file is evicted (dmaload.evict: fdatasync +
POSIX_FADV_DONTNEED; also ``echo 1 > /proc/sys/vm/drop_caches`` when root).
Warm: the file is read once through the page cache before the child.
The "cached before" column (mincore) says what the child really found.

In each child, CUDA is initialised (context, a tiny allocation, a tiny
copy) BEFORE the timer starts: context creation is not the loader's cost.
The timer covers the loader's whole load of every tensor onto the GPU, then
torch.cuda.synchronize(). Reported per loader:

  GiB/s       file size / load time: median (min-max) over the rounds
  CPU s       the child's user+system time during the load, all threads
  RSS delta   peak host RSS during the load (VmHWM, reset after CUDA init)
              minus the RSS before it; "peak RSS" is the absolute peak.
              Pinned memory counts: cudaHostAlloc'd buffers as RssShmem,
              cudaHostRegister'd ones as RssAnon (and VmPin); the JSON has
              the peak of each of those fields, sampled every 25 ms
  checksum    per tensor (dtype, shape, byte sum, position-weighted byte
              sum) computed on the GPU after the timer, hashed over the
              sorted names; must equal the reference: safetensors' own
              load_file to the CPU, copied tensor by tensor to the GPU

then the ratios the targets name (cold: dmaload / max(best fastsafetensors,
raw ceiling) >= 1.0; warm: dmaload / pinned H2D >= 0.8; CPU dmaload <=
fastsafetensors; dmaload RSS delta <= staging ring + 5%; cached: dmaload-cache
/ pinned H2D >= 0.8).

    python3 bench/gpu.py                                   # 8 GiB, 3 rounds, everything
    python3 bench/gpu.py --size 16G --rounds 5 --json gpu.json
    python3 bench/gpu.py --file /data/model.safetensors --loaders dmaload,raw,h2d --cache cold
    python3 bench/gpu.py --dmaload-opt staging_slots=64,queue_depth=64

Without --file the model is generated (standard library only, no torch)
in a temporary directory under the repository's .dev/ (the same disk as
the repository) and deleted afterwards unless --keep. Loaders whose
package is missing are skipped and listed. A checksum that differs from
the reference makes the exit status 3.

Not a test: absolute numbers depend on the machine; compare within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import glob
import hashlib
import importlib.util
import json
import mmap
import os
import platform
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

GIB = 1 << 30
MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
ROOT = Path(__file__).resolve().parent.parent
RESULT_MARK = "@@gpu-bench-result "
# The staging ring of dmaload's device path (dmaload/_options.py: 32 slots of 16 MiB).
DEFAULT_RING_SLOTS = 32
DEFAULT_RING_SLOT = 16 * MIB

LOADERS: dict[str, str] = {
    "dmaload": "dmaload",
    "dmaload-cache": "dmaload from the cache service",
    "safetensors": "safetensors",
    "fastsafetensors-nogds": "fastsafetensors (nogds)",
    "fastsafetensors-gds": "fastsafetensors (GDS)",
    "runai": "runai-model-streamer",
    "raw": "raw O_DIRECT read (ceiling)",
    "h2d": "H2D copy (bus ceiling)",
}
ALIASES = {"fastsafetensors": ["fastsafetensors-nogds", "fastsafetensors-gds"]}
MODULES = {  # what each loader needs to import (besides torch)
    "dmaload": "dmaload",
    "dmaload-cache": "dmaload",
    "safetensors": "safetensors",
    "fastsafetensors-nogds": "fastsafetensors",
    "fastsafetensors-gds": "fastsafetensors",
    "runai": "runai_model_streamer",
}
DEFAULT_LOADERS = "dmaload,dmaload-cache,safetensors,fastsafetensors,runai,raw,h2d"
# The cache service's socket, for the dmaload-cache children.
CACHE_SOCKET_ENV = "DMALOAD_BENCH_CACHE_SOCKET"


def log(msg: str) -> None:
    """A progress line on stderr, flushed at once."""
    print(msg, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
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


def write_model(path: Path, size: int) -> tuple[str, int]:
    """Writes the model: the safetensors format itself (u64 LE header length,
    JSON header padded with spaces to 8 bytes, data in name order), filled
    with one random 64 MiB block rotated by a different amount per tensor
    and per block, so no two pages are alike. Returns (config, tensors)."""
    config, layout = model_layout(size)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "generator": "dmaload bench/gpu.py"}}
    offset = 0
    sizes = []
    for name, shape in sorted(layout):
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
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


def evict(path: Path) -> None:
    """Drops the file from the page cache (dmaload.evict, the core's) and, as
    root, all clean caches."""
    import dmaload

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


# --------------------------------------------------------------------------
# Child side: one load in this fresh process, the result as one JSON line


def _status() -> dict[str, int]:
    """Bytes of the memory fields of /proc/self/status."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if rest.strip().endswith(" kB"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class Sampler:
    """Samples memory fields every ``interval`` seconds on a thread, keeping the peaks."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmPin", "VmLck")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        st = _status()
        for k in self.FIELDS:
            self.peak[k] = max(self.peak.get(k, 0), st.get(k, 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> Sampler:
        self._sample()
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


def _reset_hwm() -> bool:
    """Resets VmHWM (and ru_maxrss) to the current RSS (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


_WEIGHTS: dict[str, Any] = {}
CHECK_CHUNK = 32 * MIB


def tensor_sums(torch: Any, t: Any) -> tuple[int, int]:
    """(byte sum, position-weighted byte sum) of a tensor's bytes, on its device.
    Exact integers (no overflow at these sizes), so equal for equal bytes."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    dev = b.device
    w = _WEIGHTS.get(str(dev))
    if w is None:
        w = torch.arange(CHECK_CHUNK, dtype=torch.int64, device=dev) % 65521 + 1
        _WEIGHTS[str(dev)] = w
    s1 = torch.zeros((), dtype=torch.int64, device=dev)
    s2 = torch.zeros((), dtype=torch.int64, device=dev)
    for i, off in enumerate(range(0, b.numel(), CHECK_CHUNK)):
        x = b[off : off + CHECK_CHUNK].to(torch.int64)
        s1 += x.sum()
        s2 += (x * w[: x.numel()]).sum() * (2 * i + 1)
    return int(s1), int(s2)


def checksum(torch: Any, tensors: dict[str, Any]) -> tuple[str, dict[str, list[Any]]]:
    """(digest, {name: [dtype, shape, nbytes, sum, weighted sum]})."""
    per: dict[str, list[Any]] = {}
    for name in sorted(tensors):
        t = tensors[name]
        s1, s2 = tensor_sums(torch, t)
        per[name] = [str(t.dtype).replace("torch.", ""), list(t.shape), t.numel() * t.element_size(), s1, s2]
    digest = hashlib.sha256(json.dumps(per, sort_keys=True).encode()).hexdigest()[:16]
    return digest, per


Loaded = tuple[dict[str, Any], Callable[[], None]]


def _prepare(loader: str, torch: Any, dev: Any, opts: dict[str, Any], info: dict[str, Any]) -> Callable[[str], Loaded]:
    """Imports the loader (not timed) and returns its load: path -> (tensors, close)."""
    sdev = str(dev)

    def on_device(out: dict[str, Any]) -> dict[str, Any]:
        # A loader may hand back a tensor elsewhere (e.g. an empty one on the
        # CPU): it is moved inside the timed load, and counted.
        moved = 0
        for k, t in out.items():
            if t.device != dev:
                out[k] = t.to(dev)
                moved += 1
        info["moved_to_device"] = moved
        return out

    if loader in ("dmaload", "dmaload-cache"):
        import dmaload
        from dmaload.safetensors.torch import load_file as dl_load

        info["version"] = getattr(dmaload, "__version__", "?")
        # From the service the parent started and primed, or (False) never.
        cache = os.environ[CACHE_SOCKET_ENV] if loader == "dmaload-cache" else False

        def run(path: str) -> Loaded:
            return on_device(dl_load(path, device=sdev, cache=cache, **opts)), lambda: None

        return run
    if loader == "safetensors":
        import safetensors
        from safetensors.torch import load_file as st_load

        info["version"] = safetensors.__version__

        def run(path: str) -> Loaded:
            return on_device(st_load(path, device=sdev)), lambda: None

        return run
    if loader.startswith("fastsafetensors"):
        import logging
        import warnings

        import fastsafetensors
        from fastsafetensors import SafeTensorsFileLoader

        try:
            from fastsafetensors import SingleGroup
        except ImportError:  # older releases
            from fastsafetensors.common import SingleGroup

        info["version"] = getattr(fastsafetensors, "__version__", "?")
        gds = loader.endswith("-gds")
        if gds:
            from fastsafetensors import cpp as fstcpp

            if not os.path.exists("/dev/nvidia-fs0"):
                raise Unavailable("GDS unavailable: no /dev/nvidia-fs0 (nvidia-fs module / device nodes)")
            if not fstcpp.is_cufile_found():
                raise Unavailable("GDS unavailable: fastsafetensors finds no libcufile.so.0")
        notes: list[str] = []

        class Grab(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.levelno >= logging.WARNING:
                    notes.append(record.getMessage())

        logging.getLogger("fastsafetensors").addHandler(Grab())

        def run(path: str) -> Loaded:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fl = SafeTensorsFileLoader(SingleGroup(), device=sdev, nogds=not gds)
                fl.add_filenames({0: [path]})
                fb = fl.copy_files_to_device()
                out = {k: fb.get_tensor(k) for k in fl.get_keys()}
            notes.extend(str(w.message) for w in caught)
            copier = getattr(getattr(fl, "copier_class", None), "__name__", "?")
            info["copier"] = copier
            if notes:
                info["notes"] = notes
            if gds and (copier != "GdsFileCopier" or any("falling back" in n or "fall back" in n for n in notes)):
                info["unavailable"] = f"GDS unavailable: fastsafetensors used {copier}: {'; '.join(notes)[:300]}"

            def close() -> None:
                fb.close()
                fl.close()

            return on_device(out), close

        return run
    if loader == "runai":
        import inspect

        from runai_model_streamer import SafetensorsStreamer

        try:
            from importlib.metadata import version

            info["version"] = version("runai-model-streamer")
        except Exception:
            info["version"] = "?"
        has_device = "device" in inspect.signature(SafetensorsStreamer.stream_file).parameters
        info["api"] = "stream_file(path, device=DEV)" if has_device else "stream_file(path) + .to(DEV)"

        def run(path: str) -> Loaded:
            out = {}
            with SafetensorsStreamer() as s:
                if has_device:
                    s.stream_file(path, device=sdev)
                else:
                    s.stream_file(path)
                for name, t in s.get_tensors():
                    # On the CPU, get_tensors yields views of a reused buffer: copy them now.
                    out[name] = t if t.device == dev else t.to(dev)
            return on_device(out), lambda: None

        return run
    raise ValueError(f"unknown loader {loader!r}")


class Unavailable(Exception):
    """The loader cannot run here at all (skipped in later rounds)."""


def _cpu(r0: Any, r1: Any) -> dict[str, float]:
    user, sys_ = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    return {"cpu": user + sys_, "cpu_user": user, "cpu_sys": sys_}


def _cuda_init(torch: Any, device: str) -> tuple[Any, float]:
    """CUDA context, a tiny allocation and tiny copies: not the loader's cost."""
    t0 = time.perf_counter()
    torch.cuda.init()
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"--device must be a CUDA device, not {device!r}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    x = torch.ones(1024, device=dev)
    x.add_(1)
    torch.empty(4096, dtype=torch.uint8).to(dev)
    torch.empty(4096, dtype=torch.uint8, pin_memory=True).to(dev, non_blocking=True)
    torch.cuda.synchronize(dev)
    return dev, time.perf_counter() - t0


def child_load(loader: str, path: str, device: str, opts: dict[str, Any], sample: float) -> dict[str, Any]:
    import gc
    import resource

    import torch

    dev, init_s = _cuda_init(torch, device)
    info: dict[str, Any] = {"cuda_init_s": init_s, "torch": torch.__version__}
    run = _prepare(loader, torch, dev, opts, info)
    gc.collect()
    torch.cuda.synchronize(dev)
    free0, total = torch.cuda.mem_get_info(dev)
    hwm_reset = _reset_hwm()
    st0 = _status()
    with Sampler(sample) as smp:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        tensors, close = run(path)
        torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    st1 = _status()
    free1, _ = torch.cuda.mem_get_info(dev)
    # ru_maxrss is reset with VmHWM; if that failed, both hold earlier peaks.
    peak = max(st1.get("VmHWM", 0), smp.peak.get("VmRSS", 0), 0 if hwm_reset else r1.ru_maxrss * 1024)
    c0 = time.perf_counter()
    digest, per = checksum(torch, tensors)
    c1 = time.perf_counter()
    close()
    res = {
        "seconds": t1 - t0,
        **_cpu(r0, r1),
        "rss_before": st0.get("VmRSS", 0),
        "rss_peak": peak,
        "rss_delta": max(0, peak - st0.get("VmRSS", 0)),
        "hwm_reset": hwm_reset,
        "peaks": {k: v - st0.get(k, 0) for k, v in smp.peak.items()},  # deltas
        "gpu_used_delta": free0 - free1,
        "gpu_total": total,
        "gpu_name": torch.cuda.get_device_name(dev),
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "checksum": digest,
        "checksum_s": c1 - c0,
        "per_tensor": per,
        **info,
    }
    return res


def child_reference(path: str, device: str) -> dict[str, Any]:
    """The reference checksum: safetensors' load_file to the CPU, each tensor
    then copied to the device and summed by the same code as the loads."""
    import safetensors
    import torch
    from safetensors.torch import load_file

    dev, _ = _cuda_init(torch, device)
    cpu = load_file(path)
    per: dict[str, list[Any]] = {}
    for name in sorted(cpu):
        t = cpu[name]
        s1, s2 = tensor_sums(torch, t.to(dev))
        per[name] = [str(t.dtype).replace("torch.", ""), list(t.shape), t.numel() * t.element_size(), s1, s2]
    digest = hashlib.sha256(json.dumps(per, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "checksum": digest,
        "per_tensor": per,
        "tensors": len(per),
        "bytes": sum(v[2] for v in per.values()),
        "safetensors": safetensors.__version__,
        "torch": torch.__version__,
        "gpu_name": torch.cuda.get_device_name(dev),
    }


def child_raw(path: str, threads: int, block: int, sample: float, direct: bool = True) -> dict[str, Any]:
    """Reads the whole file with O_DIRECT (buffered, through the page cache
    and its readahead, unless ``direct``) into ``threads`` reused buffers of
    ``block`` bytes (os.preadv releases the GIL); nothing else is done."""
    import resource

    size = os.stat(path).st_size
    fd = -1
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            direct = False  # the filesystem has no O_DIRECT
    if fd < 0:
        fd = os.open(path, os.O_RDONLY)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    bufs = [mmap.mmap(-1, block, flags=flags) for _ in range(threads)]
    for b in bufs:  # make sure every page is there before the timer
        for off in range(0, block, PAGE):
            b[off] = 0
    nblocks = (size + block - 1) // block
    lock = threading.Lock()
    state = {"next": 0, "bytes": 0}
    errors: list[BaseException] = []

    def work(buf: mmap.mmap) -> None:
        view = memoryview(buf)
        got_total = 0
        try:
            while True:
                with lock:
                    i = state["next"]
                    state["next"] = i + 1
                if i >= nblocks:
                    break
                off = i * block
                want = min(block, size - off)
                got = 0
                while got < want:
                    # Whole aligned lengths: O_DIRECT reads past EOF come back short.
                    n = os.preadv(fd, [view[got:]], off + got)
                    if n <= 0:
                        raise OSError(errno.EIO, f"short read at {off + got} of {size}")
                    got += n
                got_total += min(got, want)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        with lock:
            state["bytes"] += got_total

    hwm_reset = _reset_hwm()
    st0 = _status()
    with Sampler(sample) as smp:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        pool = [threading.Thread(target=work, args=(b,)) for b in bufs]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        t1 = time.perf_counter()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    os.close(fd)
    if errors:
        raise errors[0]
    if state["bytes"] != size:
        raise OSError(errno.EIO, f"read {state['bytes']} bytes of {size}")
    st1 = _status()
    peak = max(st1.get("VmHWM", 0), smp.peak.get("VmRSS", 0))
    return {
        "seconds": t1 - t0,
        **_cpu(r0, r1),
        "rss_before": st0.get("VmRSS", 0),
        "rss_peak": peak,
        "rss_delta": max(0, peak - st0.get("VmRSS", 0)),
        "hwm_reset": hwm_reset,
        "direct": direct,
        "threads": threads,
        "block": block,
        "bytes": size,
    }


def child_h2d(device: str, nbytes: int, repeat: int) -> dict[str, Any]:
    """Best and median GiB/s of host->device copies of ``nbytes``: pinned
    (non_blocking) and pageable, each after one untimed warm-up copy."""
    import torch

    dev, _ = _cuda_init(torch, device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out: dict[str, Any] = {"bytes": nbytes, "gpu_name": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    for kind in ("pinned", "pageable"):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(kind == "pinned"))
        src.fill_(1)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dev)
        rates = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(dev)
            rates.append(nbytes / GIB / (time.perf_counter() - t0))
        out[kind] = {"best": max(rates), "median": statistics.median(rates), "all": rates}
        del src
    return out


def child_probe() -> dict[str, Any]:
    """What this Python has: torch and CUDA, the loaders' packages, and where
    the CUDA runtime and cuFile libraries are (for fastsafetensors, which
    dlopens the unversioned libcudart.so)."""
    out: dict[str, Any] = {"python": sys.version.split()[0], "modules": {}}
    for loader, mod in MODULES.items():
        try:
            m = importlib.import_module(mod)
            out["modules"][loader] = {"ok": True, "where": getattr(m, "__file__", "?")}
        except BaseException as e:  # noqa: BLE001 - anything at import means "missing"
            out["modules"][loader] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["cuda"] = bool(torch.cuda.is_available())
        if out["cuda"]:
            torch.cuda.init()
            torch.ones(1, device="cuda")
            out["gpu_name"] = torch.cuda.get_device_name(0)
            out["gpu_count"] = torch.cuda.device_count()
    except BaseException as e:  # noqa: BLE001
        out["torch_error"] = f"{type(e).__name__}: {e}"
        out["cuda"] = False
    libs = {}
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            for key in ("libcudart.so", "libcufile.so"):
                if f"/{key}" in p:
                    libs.setdefault(key, p)
    out["cudart_loaded"] = libs.get("libcudart.so")
    for name, key in (("libcudart.so", "cudart_unversioned_ok"), ("libcufile.so.0", "cufile_ok")):
        try:
            ctypes.CDLL(name)
            out[key] = True
        except OSError:
            out[key] = False
    cufile = []
    for entry in sys.path:
        cufile += glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libcufile.so.0"))
        cufile += glob.glob(os.path.join(entry, "nvidia", "*", "lib64", "libcufile.so.0"))
    out["cufile_found"] = cufile[0] if cufile else None
    out["nvidia_fs"] = os.path.exists("/dev/nvidia-fs0")
    return out


def child_main(args: argparse.Namespace) -> int:
    kind = args.child
    try:
        if kind == "probe":
            res = child_probe()
        elif kind == "reference":
            res = child_reference(args.file, args.device)
        elif kind == "raw":
            res = child_raw(args.file, args.raw_threads, args.raw_block, args.sample_ms / 1000)
        elif kind == "h2d":
            res = child_h2d(args.device, args.h2d_size, 5)
        else:
            opts = parse_opts(args.dmaload_opt) if kind.startswith("dmaload") else {}
            res = child_load(kind, args.file, args.device, opts, args.sample_ms / 1000)
        res["ok"] = "unavailable" not in res
        if not res["ok"]:
            res["error"] = res["unavailable"]
            res["skip_rest"] = True
    except Unavailable as e:
        res = {"ok": False, "error": str(e), "skip_rest": True}
    except (ImportError, NotImplementedError) as e:
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "skip_rest": True}
    except BaseException as e:  # noqa: BLE001 - reported in the row, the bench goes on
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    sys.stdout.flush()
    print(RESULT_MARK + json.dumps(res), flush=True)
    return 0


# --------------------------------------------------------------------------
# Parent side


def parse_opts(text: str | None) -> dict[str, Any]:
    """``k=v,k=v`` -> dict, numbers as ints."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        k, sep, v = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--dmaload-opt wants key=value, got {item!r}")
        out[k.strip()] = int(v) if v.strip().isdigit() else v.strip()
    return out


def ring_bytes(opts: dict[str, Any]) -> int:
    slots = int(opts.get("staging_slots", DEFAULT_RING_SLOTS))
    slot = opts.get("staging_slot_size", DEFAULT_RING_SLOT)
    return slots * (slot if isinstance(slot, int) else parse_size(str(slot)))


class Runner:
    def __init__(self, args: argparse.Namespace, path: Path, env: dict[str, str], fst_env: dict[str, str]) -> None:
        self.args, self.path, self.env, self.fst_env = args, path, env, fst_env

    def child(self, kind: str, timeout: float | None = None) -> dict[str, Any]:
        a = self.args
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--file", str(self.path),
               "--device", a.device, "--raw-threads", str(a.raw_threads), "--raw-block", str(a.raw_block),
               "--h2d-size", str(a.h2d_size), "--sample-ms", str(a.sample_ms)]  # fmt: skip
        if a.dmaload_opt:
            cmd += ["--dmaload-opt", a.dmaload_opt]
        env = self.fst_env if kind.startswith("fastsafetensors") else self.env
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout or a.timeout)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            return {"ok": False, "error": f"timed out after {timeout or a.timeout:.0f} s", "stderr": err[-1500:]}
        wall = time.perf_counter() - t0
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
        if not lines:
            tail = proc.stderr.strip()[-1500:]
            return {"ok": False, "error": f"child exited {proc.returncode} without a result: {tail[-300:]}",
                    "stderr": tail}  # fmt: skip
        res = json.loads(lines[-1][len(RESULT_MARK) :])
        res["wall_s"] = wall
        if not res.get("ok"):
            res["stderr"] = proc.stderr.strip()[-1500:]
        return res


class CacheService:
    """A ``dmaload serve`` for the dmaload-cache loader, primed with the file
    by one request, so its children find the model in the service's memory
    whatever the page cache holds."""

    def __init__(self, cli: str, socket: Path, log_path: Path) -> None:
        self.socket = socket
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([cli, "serve", "--socket", str(socket)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"`{cli} serve` did not start: {log_path.read_text()[-300:]}")
            time.sleep(0.05)

    def prime(self, path: Path, env: dict[str, str]) -> None:
        code = "import sys, dmaload; dmaload.load(sys.argv[1], cache=sys.argv[2])"
        subprocess.run([sys.executable, "-c", code, str(path), str(self.socket)], env=env, check=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)
        self.log.close()


def fmt_gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return None
    g = [r["gibs"] for r in ok]
    return {
        "n": len(ok),
        "gibs_median": statistics.median(g),
        "gibs_min": min(g),
        "gibs_max": max(g),
        "cpu_median": statistics.median(r["cpu"] for r in ok),
        "rss_delta_max": max(r["rss_delta"] for r in ok),
        "rss_peak_max": max(r["rss_peak"] for r in ok),
        "cached_before": statistics.median(r["cached_before"] for r in ok),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", help="an existing safetensors file (default: generate one)")
    ap.add_argument("--size", type=parse_size, default=8 * GIB, help="size of the generated model (default 8G)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="rounds; each runs every loader once per cache state (default 3)"
    )
    ap.add_argument("--device", default="cuda:0", help="CUDA device (default cuda:0)")
    ap.add_argument("--loaders", default=DEFAULT_LOADERS,
                    help=f"comma-separated (default {DEFAULT_LOADERS}); fastsafetensors = "
                    "fastsafetensors-nogds + fastsafetensors-gds")  # fmt: skip
    ap.add_argument("--cache", default="cold,warm", help="cache states: cold, warm or both (default cold,warm)")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument("--keep", action="store_true", help="keep the generated model (its path is printed)")
    ap.add_argument(
        "--cli",
        default=os.environ.get("DMALOAD_CLI") or shutil.which("dmaload") or str(ROOT / "target" / "release" / "dmaload"),
        help="the dmaload executable that serves the dmaload-cache loader (default $DMALOAD_CLI, then PATH, then "
        "target/release/dmaload)",
    )
    ap.add_argument(
        "--dir", type=Path, default=ROOT / ".dev", help="where a generated model goes (default <repo>/.dev)"
    )
    ap.add_argument("--dmaload-opt", default="", help="dmaload load options, e.g. staging_slots=64,queue_depth=64")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one child may take (default 900)")
    ap.add_argument("--raw-threads", type=int, default=16, help="threads of the raw read (default 16)")
    ap.add_argument("--raw-block", type=parse_size, default=16 * MIB, help="buffer per raw thread (default 16M)")
    ap.add_argument("--h2d-size", type=parse_size, default=GIB, help="bytes per H2D copy (default 1G)")
    ap.add_argument(
        "--sample-ms", type=float, default=25, help="memory sampling period in a child, 0: off (default 25)"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args)

    wanted: list[str] = []
    for name in filter(None, (s.strip() for s in args.loaders.split(","))):
        for n in ALIASES.get(name, [name]):
            if n not in LOADERS:
                ap.error(f"unknown loader {n!r} (known: {', '.join([*LOADERS, *ALIASES])})")
            if n not in wanted:
                wanted.append(n)
    caches = [c.strip() for c in args.cache.split(",") if c.strip()]
    if not caches or any(c not in ("cold", "warm") for c in caches):
        ap.error("--cache takes cold, warm or cold,warm")
    dl_opts = parse_opts(args.dmaload_opt)

    # Children's environment: dmaload from the source tree when it is built
    # there and not installed; runai's own INFO lines off.
    env = dict(os.environ, RUNAI_STREAMER_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1")
    src = ROOT / "bindings" / "python" / "python"
    if importlib.util.find_spec("dmaload") is None and list((src / "dmaload").glob("_dmaload*.so")):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
        log(f"dmaload: not installed, using the build in {src}")

    workdir: Path | None = None
    service: CacheService | None = None
    shimdir = Path(tempfile.mkdtemp(prefix="dmaload-gpu-bench-ld-"))
    generated = args.file is None
    status = 0
    try:
        runner = Runner(args, Path(args.file or "/nonexistent"), env, env)
        probe = runner.child("probe", timeout=300)
        if not probe.get("ok"):
            log(f"probe failed: {probe.get('error')}")
        # fastsafetensors dlopens "libcudart.so" (and "libcufile.so.0"): point
        # them at torch's own copies when the loader path lacks them.
        fst_env = dict(env)
        shims = []
        if probe.get("cudart_loaded") and not probe.get("cudart_unversioned_ok"):
            os.symlink(probe["cudart_loaded"], shimdir / "libcudart.so")
            shims.append(f"libcudart.so -> {probe['cudart_loaded']}")
        if probe.get("cufile_found") and not probe.get("cufile_ok"):
            os.symlink(probe["cufile_found"], shimdir / "libcufile.so.0")
            shims.append(f"libcufile.so.0 -> {probe['cufile_found']}")
        if shims:
            fst_env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(shimdir), env.get("LD_LIBRARY_PATH")]))
            log(f"fastsafetensors: linked {'; '.join(shims)}")

        skipped: dict[str, str] = {}
        loaders = []
        for n in wanted:
            if n != "raw" and not probe.get("cuda"):
                skipped[n] = "no CUDA: " + probe.get("torch_error", "torch sees no CUDA device")
            elif n in MODULES and not probe.get("modules", {}).get(n, {}).get("ok"):
                skipped[n] = "not installed: " + probe.get("modules", {}).get(n, {}).get("error", "?")
            else:
                loaders.append(n)
        for n, why in skipped.items():
            log(f"skipped {LOADERS[n]}: {why}")
        tensor_loaders = [n for n in loaders if n not in ("raw", "h2d")]
        if not loaders:
            log("nothing to run")
            return 1

        # The model.
        if generated:
            args.dir.mkdir(parents=True, exist_ok=True)
            workdir = Path(tempfile.mkdtemp(prefix="gpu-bench-", dir=args.dir))
            path = workdir / "model.safetensors"
            t0 = time.perf_counter()
            log(f"generating {path} (about {args.size / GIB:.2f} GiB) ...")
            config, n = write_model(path, args.size)
            dt = time.perf_counter() - t0
            log(f"generated {n} tensors ({config}), {path.stat().st_size / GIB:.2f} GiB in {dt:.1f} s")
        else:
            path = Path(args.file).resolve()
            config = "given"
        runner.path = path
        runner.fst_env = fst_env
        size = path.stat().st_size
        header, data_start = read_header(path)
        header_bytes = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())

        # The reference checksum.
        reference: dict[str, Any] | None = None
        if tensor_loaders:
            if probe.get("modules", {}).get("safetensors", {}).get("ok"):
                log("reference checksum: safetensors load_file to the CPU, summed on the GPU ...")
                reference = runner.child("reference")
                if not reference.get("ok"):
                    log(f"reference FAILED: {reference.get('error')}")
                    reference = None
                elif reference["tensors"] != len(header) or reference["bytes"] != header_bytes:
                    log(f"reference has {reference['tensors']} tensors / {reference['bytes']} bytes, "
                        f"the header {len(header)} / {header_bytes}")  # fmt: skip
                    status = 3
            if reference is None:
                log("no reference checksum (safetensors missing or failed): loaders are compared with each other")

        where = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True)
        fs = " ".join(where.stdout.split()[2:]) if where.returncode == 0 else "?"
        log(f"file {path}: {size / GIB:.2f} GiB, {len(header)} tensors, data from byte {data_start}, on {fs}")
        if "dmaload-cache" in loaders:
            try:
                if not os.access(args.cli, os.X_OK):
                    raise Unavailable(f"no dmaload executable at {args.cli} (--cli)")
                service = CacheService(args.cli, shimdir / "cache.sock", shimdir / "serve.log")
                log(f"dmaload-cache: `{args.cli} serve` at {service.socket}, loading the file into it ...")
                service.prime(path, env)
                env[CACHE_SOCKET_ENV] = str(service.socket)
            except (Unavailable, OSError, subprocess.CalledProcessError) as e:
                loaders.remove("dmaload-cache")
                tensor_loaders.remove("dmaload-cache")
                skipped["dmaload-cache"] = str(e)
                log(f"skipped {LOADERS['dmaload-cache']}: {e}")
        log(f"loaders: {', '.join(loaders)}; cache: {', '.join(caches)}; {args.rounds} round(s), interleaved")

        runs: list[dict[str, Any]] = []
        h2d: list[dict[str, Any]] = []
        gone: dict[str, str] = {}  # loaders that cannot run here, and why
        ref_sum = reference["checksum"] if reference else None
        ref_per = reference["per_tensor"] if reference else None
        main_loaders = [n for n in loaders if n != "h2d"]
        for rnd in range(args.rounds):
            if "h2d" in loaders:
                res = runner.child("h2d")
                res["round"] = rnd + 1
                h2d.append(res)
                if res.get("ok"):
                    log(f"[round {rnd + 1}/{args.rounds}] H2D 1 copy of {res['bytes'] / GIB:.2f} GiB: pinned best "
                        f"{res['pinned']['best']:.2f} GiB/s, pageable best {res['pageable']['best']:.2f} GiB/s")  # fmt: skip
                else:
                    log(f"[round {rnd + 1}/{args.rounds}] H2D FAILED: {res.get('error')}")
            # A different order each round (the same in every run), so no
            # loader always follows the same one and inherits its effects.
            order = list(main_loaders)
            random.Random(rnd).shuffle(order)
            for cache in caches:
                for n in order:
                    if n in gone:
                        continue
                    if cache == "cold":
                        evict(path)
                        time.sleep(0.2)
                    else:
                        warm(path)
                    cached = resident_bytes(path) / size
                    res = runner.child(n)
                    res.update(loader=n, cache=cache, round=rnd + 1, cached_before=cached)
                    if res.get("ok"):
                        res["gibs"] = size / GIB / res["seconds"]
                        if n != "raw":
                            if ref_sum is None:
                                ref_sum, ref_per = res["checksum"], res["per_tensor"]
                                res["checksum_ok"] = None  # it is the reference
                            else:
                                res["checksum_ok"] = res["checksum"] == ref_sum
                                if not res["checksum_ok"]:
                                    status = 3
                                    per = res["per_tensor"]
                                    bad = sorted(k for k in set(per) | set(ref_per or {})
                                                 if per.get(k) != (ref_per or {}).get(k))  # fmt: skip
                                    res["mismatched"] = bad
                        res.pop("per_tensor", None)
                        ck = {True: "checksum ok", False: "CHECKSUM MISMATCH", None: "checksum (reference)"}.get(
                            res.get("checksum_ok", "-"), ""
                        )
                        if res.get("mismatched"):
                            ck += f" in {len(res['mismatched'])} tensors, e.g. {res['mismatched'][:3]}"
                        log(f"[round {rnd + 1}/{args.rounds} {cache} {cached * 100:3.0f}% cached] {LOADERS[n]}: "
                            f"{res['gibs']:.2f} GiB/s, {res['seconds']:.2f} s, cpu {res['cpu']:.2f} s, "
                            f"rss delta {fmt_gib(res['rss_delta'])} GiB (peak {fmt_gib(res['rss_peak'])}), "
                            f"{ck}")  # fmt: skip
                    else:
                        log(f"[round {rnd + 1}/{args.rounds} {cache}] {LOADERS[n]}: FAILED {res.get('error')}")
                        if res.get("skip_rest"):
                            gone[n] = res.get("error", "?")
                    runs.append(res)
        if generated:
            evict(path)

        # Report.
        out = sys.stdout
        gpu = probe.get("gpu_name", "no GPU")
        init = [r["cuda_init_s"] for r in runs if r.get("ok") and "cuda_init_s" in r]
        print(f"\n## GPU load: {size / GIB:.2f} GiB safetensors ({len(header)} tensors, {config}) on {gpu}", file=out)
        print(f"\nfile {path} ({fs}); torch {probe.get('torch', '-')} (CUDA {probe.get('torch_cuda', '-')}), "
              f"Python {probe.get('python')}, {os.cpu_count()} CPUs, Linux {platform.release()}", file=out)  # fmt: skip
        try:
            drv = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
            print("NVIDIA driver " + next(w for w in drv.split() if re.fullmatch(r"\d+\.\d+(\.\d+)*", w)), file=out)
        except (OSError, IndexError, StopIteration):
            pass
        vers = {}
        for r in runs:
            if r.get("ok") and r.get("version"):
                vers.setdefault(r["loader"], r["version"])
        if vers:
            print("versions: " + ", ".join(f"{LOADERS[k]} {v}" for k, v in vers.items()), file=out)
        print(f"{args.rounds} round(s), each loader in a fresh process, interleaved. GiB/s = file size / load "
              "time. CUDA context creation is done before the timer and not counted"
              + (f" (median {statistics.median(init):.2f} s)." if init else "."), file=out)  # fmt: skip
        for n, why in {**skipped, **gone}.items():
            print(f"- {LOADERS[n]}: {why}", file=out)

        summary: dict[str, dict[str, Any]] = {}
        for cache in caches:
            print(f"\n### {cache} cache\n", file=out)
            print("| loader | GiB/s median (min–max) | CPU s median | peak RSS delta GiB | peak RSS GiB "
                  "| cached before | checksum ok |", file=out)  # fmt: skip
            print("|---|---|---:|---:|---:|---:|---|", file=out)
            summary[cache] = {}
            for n in main_loaders:
                rs = [r for r in runs if r["loader"] == n and r["cache"] == cache]
                s = summarize(rs)
                if s is None:
                    err = next((r.get("error") for r in rs if r.get("error")), skipped.get(n, "not run"))
                    print(
                        f"| {LOADERS[n]} | {' '.join(str(err).split())[:160].replace('|', '/')} | | | | | |", file=out
                    )
                    continue
                summary[cache][n] = s
                cks = [r.get("checksum_ok") for r in rs if r.get("ok")]
                ck = "–" if n == "raw" else "MISMATCH" if False in cks else "reference" if None in cks else "yes"
                fails = len(rs) - s["n"]
                gibs = f"{s['gibs_median']:.2f} ({s['gibs_min']:.2f}–{s['gibs_max']:.2f})" + (
                    f", {fails} failed" if fails else ""
                )
                print(f"| {LOADERS[n]} | {gibs} | {s['cpu_median']:.2f} | {fmt_gib(s['rss_delta_max'])} "
                      f"| {fmt_gib(s['rss_peak_max'])} | {s['cached_before'] * 100:.0f}% | {ck} |", file=out)  # fmt: skip

        okh = [r for r in h2d if r.get("ok")]
        pinned = max((r["pinned"]["best"] for r in okh), default=None)
        if okh:
            pageable = max(r["pageable"]["best"] for r in okh)
            print(f"\nH2D ({fmt_gib(okh[0]['bytes'])} GiB copies, best of 5 per round, best round): pinned "
                  f"{pinned:.2f} GiB/s, pageable {pageable:.2f} GiB/s", file=out)  # fmt: skip

        print("\n### Targets\n", file=out)
        verdict = lambda ok: "met" if ok else "NOT MET"  # noqa: E731
        cold, warm_s = summary.get("cold", {}), summary.get("warm", {})
        targets: dict[str, Any] = {}
        dm = cold.get("dmaload")
        peers = {
            n: cold[n]["gibs_median"] for n in ("fastsafetensors-nogds", "fastsafetensors-gds", "raw") if n in cold
        }
        if "cold" in caches:
            if dm and peers:
                best = max(peers, key=peers.__getitem__)
                ratio = dm["gibs_median"] / peers[best]
                targets["cold"] = {"ratio": ratio, "against": best, "met": ratio >= 1.0}
                detail = ", ".join(f"{LOADERS[k]} {v:.2f}" for k, v in peers.items())
                print(f"- cold: dmaload {dm['gibs_median']:.2f} GiB/s / best of ({detail}) = **{ratio:.2f}×** "
                      f"(target ≥ 1.0: {verdict(ratio >= 1.0)})", file=out)  # fmt: skip
            else:
                print("- cold: n/a (needs dmaload and fastsafetensors or raw results)", file=out)
        if "warm" in caches:
            dw = warm_s.get("dmaload")
            if dw and pinned:
                ratio = dw["gibs_median"] / pinned
                targets["warm"] = {"ratio": ratio, "met": ratio >= 0.8}
                print(f"- warm: dmaload {dw['gibs_median']:.2f} GiB/s / pinned H2D {pinned:.2f} GiB/s = "
                      f"**{ratio:.2f}×** (target ≥ 0.8: {verdict(ratio >= 0.8)})", file=out)  # fmt: skip
            else:
                print("- warm: n/a (needs dmaload warm and H2D results)", file=out)
        served = [summary[c]["dmaload-cache"] for c in caches if "dmaload-cache" in summary[c]]
        if served and pinned:
            best = max(served, key=lambda x: x["gibs_median"])
            ratio = best["gibs_median"] / pinned
            targets["cached"] = {"ratio": ratio, "met": ratio >= 0.8}
            print(f"- cached → device: dmaload from the cache service {best['gibs_median']:.2f} GiB/s / pinned H2D "
                  f"{pinned:.2f} GiB/s = **{ratio:.2f}×** (target ≥ 0.8: {verdict(ratio >= 0.8)})", file=out)  # fmt: skip
        for cache in caches:
            d, f = summary[cache].get("dmaload"), summary[cache].get("fastsafetensors-nogds")
            if d and f:
                ok = d["cpu_median"] <= f["cpu_median"]
                targets[f"cpu_{cache}"] = {"dmaload": d["cpu_median"], "fastsafetensors": f["cpu_median"], "met": ok}
                print(f"- CPU ({cache}): dmaload {d['cpu_median']:.2f} s vs fastsafetensors (nogds) "
                      f"{f['cpu_median']:.2f} s (target ≤: {verdict(ok)})", file=out)  # fmt: skip
        ring = ring_bytes(dl_opts)
        dms = [s["dmaload"] for s in summary.values() if "dmaload" in s]
        if dms:
            rss = max(s["rss_delta_max"] for s in dms)
            ok = rss <= ring * 1.05
            targets["rss"] = {"rss_delta": rss, "ring": ring, "met": ok}
            print(f"- host RSS: dmaload peak RSS delta {fmt_gib(rss)} GiB vs staging ring {fmt_gib(ring)} GiB "
                  f"+ 5% = {fmt_gib(ring * 1.05)} GiB (target ≤: {verdict(ok)})", file=out)  # fmt: skip
        bad = [r for r in runs if r.get("checksum_ok") is False]
        if bad:
            print(f"\n**CHECKSUM MISMATCH** in {len(bad)} run(s): "
                  + ", ".join(sorted({LOADERS[r['loader']] for r in bad})), file=out)  # fmt: skip
        out.flush()

        if args.json:
            args.json.write_text(json.dumps({
                "file": str(path), "size": size, "tensors": len(header), "config": config, "filesystem": fs,
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "probe": probe, "skipped": skipped, "unavailable": gone,
                "reference": {k: v for k, v in (reference or {}).items() if k != "per_tensor"},
                "runs": runs, "h2d": h2d, "summary": summary, "targets": targets,
            }, indent=1))  # fmt: skip
            log(f"wrote {args.json}")
        return status
    finally:
        if service is not None:
            service.stop()
        shutil.rmtree(shimdir, ignore_errors=True)
        if workdir is not None:
            if args.keep:
                log(f"kept {workdir / 'model.safetensors'} (pass --file to reuse it)")
            else:
                shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
