#!/usr/bin/env python3
"""Cold-load benchmark of dmaload against its peers, side by side in one run.

Generates one LLM-shaped safetensors model (bench/_common.py's, in F16:
NumPy has no bfloat16), then loads it to CPU memory with
every peer, each run in a fresh process with the file evicted from the page
cache first (dmaload.evict: fdatasync + POSIX_FADV_DONTNEED; no root needed;
as root also every clean cache), the peers
interleaved round by round. Every run ends by touching one byte per page of
every tensor, so a loader that only maps the file pays for the reads too.

Peers (those whose package is missing are skipped and listed):

  dmaload (np|pt)        dmaload.safetensors.load_file, framework np / pt
  safetensors (np|pt)    safetensors.numpy / safetensors.torch.load_file
  fastsafetensors        fastsafe_open(device="cpu", nogds=True)
  runai-model-streamer   SafetensorsStreamer().stream_file + get_tensors
  fio (ceiling)          `dmaload-bench fio` (the benchmarks' fio runner,
                         the ceiling of `dmaload-bench load`): O_DIRECT
                         io_uring sequential read of the file with registered
                         buffers and files, 4 MiB at QD16 and QD64 (the
                         better one), into one small buffer: no allocation

Reported per peer: median GiB/s (min-max), CPU seconds (user+system, all
threads), peak RSS added by the load (VmHWM after clear_refs minus the RSS
before the load, memfd and mapped-file pages included) as a multiple of the
model size, page-cache residue left by the load (mincore), and each median
against the best non-dmaload peer's. A run whose tensors differ from the
file's (count, or the sum of the bytes it touched) fails.

    python bench/peers.py --size 3G --runs 3
    python bench/peers.py --size 2G --runs 5 --peers dmaload-pt,safetensors-pt,fio

Not a test: absolute numbers depend on the machine; compare ratios within
one run.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GIB, PAGE, bench_cli, evict, parse_size, resident_bytes, write_model  # noqa: E402

# --------------------------------------------------------------------------
# The model's reference


def expected_checksum(path: Path) -> tuple[int, int]:
    """(tensor count, checksum) of the model as ``_touch`` sums it: one byte
    per page of every tensor's bytes, read from the file itself (the
    reference every peer's tensors must match). The file is evicted after."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        (n,) = struct.unpack("<Q", mm[:8])
        header = json.loads(mm[8 : 8 + n])
        base = 8 + n
        total, tensors = 0, 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            total += sum(mm[base + begin : base + end : PAGE])
            tensors += 1
    evict(path)
    return tensors, total


# --------------------------------------------------------------------------
# Peers (each runs in its own child process)


def _touch(tensors: dict[str, Any]) -> int:
    """Reads one byte per page of every tensor; returns a checksum."""
    total = 0
    for t in tensors.values():
        if hasattr(t, "untyped_storage"):  # torch
            import torch

            flat = t.detach().reshape(-1).view(torch.uint8) if t.numel() else None
            if flat is not None:
                total += int(flat[::PAGE].sum())
        else:
            import numpy as np

            flat = t.reshape(-1).view(np.uint8)
            total += int(flat[::PAGE].sum())
    return total


def _prepare_dmaload(framework: str) -> Callable[[str], dict[str, Any]]:
    import dmaload.safetensors as d

    if framework == "pt":
        import torch  # noqa: F401
    else:
        import numpy  # noqa: F401
    return lambda path: d.load_file(path, framework=framework)  # type: ignore[arg-type]


def _prepare_st(framework: str) -> Callable[[str], dict[str, Any]]:
    if framework == "pt":
        from safetensors.torch import load_file
    else:
        from safetensors.numpy import load_file  # type: ignore[assignment]
    return lambda path: load_file(path)


def _prepare_fastsafetensors() -> Callable[[str], dict[str, Any]]:
    import torch  # noqa: F401
    from fastsafetensors import fastsafe_open

    def run(path: str) -> dict[str, Any]:
        f = fastsafe_open(path, framework="pt", device="cpu", nogds=True)
        return {k: f.get_tensor(k) for k in f.keys()}

    return run


def _prepare_runai() -> Callable[[str], dict[str, Any]]:
    import torch  # noqa: F401
    from runai_model_streamer import SafetensorsStreamer

    def run(path: str) -> dict[str, Any]:
        out = {}
        with SafetensorsStreamer() as s:
            s.stream_file(path)
            for name, t in s.get_tensors():
                out[name] = t
        return out

    return run


PEERS: dict[str, tuple[str, Callable[[], Callable[[str], dict[str, Any]]] | None, str]] = {
    "dmaload-np": ("dmaload (np)", lambda: _prepare_dmaload("np"), "dmaload"),
    "dmaload-pt": ("dmaload (pt)", lambda: _prepare_dmaload("pt"), "dmaload"),
    "safetensors-np": ("safetensors (np)", lambda: _prepare_st("np"), "safetensors"),
    "safetensors-pt": ("safetensors (pt)", lambda: _prepare_st("pt"), "safetensors"),
    "fastsafetensors": ("fastsafetensors", _prepare_fastsafetensors, "fastsafetensors"),
    "runai": ("runai-model-streamer", _prepare_runai, "runai_model_streamer"),
    "fio": ("fio (ceiling)", None, ""),
}


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


def child(peer: str, path: str) -> None:
    import resource

    prepare = PEERS[peer][1]
    assert prepare is not None
    run = prepare()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (Linux 4.0)
    except OSError:
        pass
    rss0 = _status("VmRSS")
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    tensors = run(path)
    checksum = _touch(tensors)
    t1 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    hwm = _status("VmHWM")
    print(
        json.dumps(
            {
                "seconds": t1 - t0,
                "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                "peak_rss": max(0, hwm - rss0),
                "tensors": len(tensors),
                "checksum": checksum,
            }
        )
    )


def run_fio(path: Path) -> dict[str, Any]:
    """The best of fio's O_DIRECT io_uring sequential reads at QD16 and QD64
    (4 MiB requests, one small buffer), each from a cold cache: the native
    benchmarks' one fio runner (``dmaload-bench fio``), which evicts before each."""
    cli = bench_cli()
    assert cli is not None
    out = subprocess.run(
        [cli, "fio", str(path), "--block-size", "4M", "--iodepth", "16", "--iodepth", "64", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    best: dict[str, Any] | None = None
    for line in out.stdout.splitlines():
        job = json.loads(line)
        runtime = max(job["seconds"], 1e-9)
        # fio's own CPU seconds for the job (its job thread, from the start of its I/O to its end).
        run = {"seconds": runtime, "cpu": job["cpu_seconds"], "peak_rss": 0, "tensors": 0, "iodepth": job["iodepth"]}
        if best is None or run["seconds"] < best["seconds"]:
            best = run
    assert best is not None
    return best


def run_peer(peer: str, path: Path) -> dict[str, Any]:
    if peer == "fio":
        return run_fio(path)
    env = dict(os.environ, RUNAI_STREAMER_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, __file__, "--child", peer, str(path)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{peer} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def available(peer: str) -> bool:
    if peer == "fio":
        return shutil.which("fio") is not None and bench_cli() is not None
    import importlib.util

    return importlib.util.find_spec(PEERS[peer][2]) is not None


# --------------------------------------------------------------------------
# Main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=3 * GIB, help="model size (default 3G)")
    ap.add_argument("--runs", type=int, default=3, help="runs per peer (default 3)")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/dmaload-bench"), help="where the model lives")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated: " + ",".join(PEERS))
    ap.add_argument("--json", type=Path, help="also write all runs as JSON here")
    ap.add_argument("--child", nargs=2, metavar=("PEER", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0

    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"model-{args.size >> 20}M.safetensors"
    if not path.exists():
        t0 = time.perf_counter()
        _, n = write_model(path, args.size, dtype="F16")
        print(f"generated {path}: {n} tensors, {path.stat().st_size / GIB:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    size = path.stat().st_size
    wanted = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PEERS]
    if unknown:
        ap.error(f"unknown peer(s): {', '.join(unknown)}")
    peers = [p for p in wanted if available(p)]
    skipped = [p for p in wanted if p not in peers]
    if skipped:
        print(f"skipped (not installed): {', '.join(skipped)}")
    want_tensors, want_checksum = expected_checksum(path)
    print(f"model {path} ({size / GIB:.2f} GiB), {args.runs} runs per peer, interleaved, cache evicted before each")

    results: dict[str, list[dict[str, Any]]] = {p: [] for p in peers}
    for r in range(args.runs):
        # A different order each round (the same in every run), so no peer
        # always follows the same one and inherits its effects.
        order = list(peers)
        random.Random(r).shuffle(order)
        for peer in order:
            evict(path)
            time.sleep(0.3)
            try:
                res = run_peer(peer, path)
                # A loader that returns wrong bytes fails its run, however fast.
                if peer != "fio" and (res["tensors"], res["checksum"]) != (want_tensors, want_checksum):
                    raise RuntimeError(
                        f"wrong tensors: {res['tensors']} tensors, checksum {res['checksum']}; "
                        f"the file holds {want_tensors}, checksum {want_checksum}"
                    )
            except Exception as exc:  # a peer failing is reported, not fatal
                print(f"  run {r + 1} {peer}: FAILED {exc}")
                continue
            res["residue"] = resident_bytes(path)
            res["gibs"] = size / GIB / res["seconds"]
            results[peer].append(res)
            print(
                f"  run {r + 1} {PEERS[peer][0]:<22} {res['gibs']:6.2f} GiB/s  cpu {res['cpu']:5.2f} s  "
                f"peak rss {res['peak_rss'] / GIB:5.2f} GiB  cache {res['residue'] / GIB:5.2f} GiB"
            )
    evict(path)

    med = {p: statistics.median(x["gibs"] for x in rs) for p, rs in results.items() if rs}
    best_peer = max((p for p in med if not p.startswith("dmaload") and p != "fio"), key=med.__getitem__, default=None)
    best = med[best_peer] if best_peer else None
    print()
    print(f"model {size / GIB:.2f} GiB; best peer: {PEERS[best_peer][0] if best_peer else 'none'}")
    head = (
        f"| {'loader':<22} | {'GiB/s median (min-max)':<22} | {'CPU s':>6} | {'peak RSS (x model)':>18} "
        f"| {'page cache after':>16} | {'vs best peer':>12} |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for p, rs in results.items():
        if not rs:
            print(f"| {PEERS[p][0]:<22} | {'failed':<22} | {'':>6} | {'':>18} | {'':>16} | {'':>12} |")
            continue
        g = [x["gibs"] for x in rs]
        cpu = statistics.median(x["cpu"] for x in rs)
        rss = max(x["peak_rss"] for x in rs)
        res = max(x["residue"] for x in rs)
        ratio = f"{med[p] / best:.2f}x" if best else "-"
        rss_s = "-" if p == "fio" else f"{rss / GIB:.2f} GiB ({rss / size:.2f}x)"
        gibs = f"{med[p]:.2f} ({min(g):.2f}-{max(g):.2f})"
        cache = f"{res / GIB:.2f} GiB {res / size * 100:.0f}%"
        print(
            f"| {PEERS[p][0]:<22} | {gibs:<22} | {cpu:6.2f} | {rss_s:>18} | {cache:>16} | {ratio:>12} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"size": size, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
