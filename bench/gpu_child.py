"""bench/gpu.py's child side: one load in a fresh process (``gpu.py
--child KIND``), its result printed as one JSON line after RESULT_MARK.
The loaders' table lives here, where the children import them."""

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
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from _common import GIB, MIB, PAGE


RESULT_MARK = "@@gpu-bench-result "

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


def parse_opts(text: str | None) -> dict[str, Any]:
    """``k=v,k=v`` -> dict, numbers as ints."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        k, sep, v = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--dmaload-opt wants key=value, got {item!r}")
        out[k.strip()] = int(v) if v.strip().isdigit() else v.strip()
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


