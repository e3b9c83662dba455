#!/usr/bin/env python3
"""The GPU path's core figures without torch: what any machine with the
NVIDIA driver and a Python can measure (bench/gpu-kit.sh's first rows).

One generated LLM-shaped safetensors file (bench/gpu.py's model), each row
run in a fresh process, the rows interleaved round by round, from a cold
page cache (evicted before each child) and a warm one (read once before):

  dmaload        `dmaload load FILE --to cuda:0 --json` (the CLI, whole
                 process: its wall time includes the driver's start-up and
                 the ring's set-up; the load's own time is the report's)
  raw direct     the file read with O_DIRECT by 16 threads into reused
                 16 MiB buffers: no allocation, nothing copied to the GPU
  raw buffered   the same through the page cache and its readahead
  pinned H2D     1 GiB copied host -> device from memory registered with
                 cuMemHostRegister, through the driver (ctypes), best of 5:
                 the link's ceiling

Ratios (medians over the rounds): cold dmaload / max(raw direct, raw
buffered) (the disk's best read of the same file in the same run); warm
dmaload / pinned H2D; and each dmaload run's process time against its
load's own. CPU seconds are each child's user + system time.

The driver is `$DMALOAD_LIBCUDA` when set (the CUDA driver emulator of
tests/cuda-emu: the rows run, byte for byte, without a GPU), else
libcuda.so.1. Not a test: compare within one run.

    python3 bench/gpu_core.py --cli target/release/dmaload --size 4G --rounds 2
    python3 bench/gpu_core.py --file model.safetensors --cache cold --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (the model, page-cache state)
from gpu_child import child_raw  # noqa: E402  (bench/gpu.py's raw reader)

ROWS = ("dmaload", "raw-direct", "raw-buffered", "h2d")
RESULT_MARK = "@@gpu-core-result "


class Driver:
    """The handful of driver calls the H2D row needs."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(os.environ.get("DMALOAD_LIBCUDA") or "libcuda.so.1")

    def __call__(self, name: str, *args: Any) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed: CUDA error {code}")


def child_h2d(nbytes: int, repeat: int) -> dict[str, Any]:
    """Best and median GiB/s of ``nbytes`` copied from registered host
    memory to device memory on one stream."""
    cu = Driver()
    c_void_p, c_size_t = ctypes.c_void_p, ctypes.c_size_t
    cu.lib.cuMemHostRegister_v2.argtypes = [c_void_p, c_size_t, ctypes.c_uint]
    cu.lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, c_void_p, c_size_t, c_void_p]
    cu("cuInit", 0)
    device, ctx = ctypes.c_int(), c_void_p()
    cu("cuDeviceGet", ctypes.byref(device), 0)
    cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
    cu("cuCtxSetCurrent", ctx)
    dst, stream = ctypes.c_uint64(), c_void_p()
    cu("cuMemAlloc_v2", ctypes.byref(dst), c_size_t(nbytes))
    cu("cuStreamCreate", ctypes.byref(stream), 1)  # CU_STREAM_NON_BLOCKING
    host = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    host.write(b"\1" * min(nbytes, 1 << 20))
    src = ctypes.addressof(ctypes.c_char.from_buffer(host))
    cu("cuMemHostRegister_v2", c_void_p(src), c_size_t(nbytes), 0)
    rates = []
    for _ in range(repeat + 1):  # the first copy is a warm-up
        t0 = time.perf_counter()
        cu("cuMemcpyHtoDAsync_v2", dst.value, c_void_p(src), c_size_t(nbytes), stream)
        cu("cuStreamSynchronize", stream)
        rates.append(nbytes / common.GIB / (time.perf_counter() - t0))
    cu("cuMemHostUnregister", c_void_p(src))
    cu("cuMemFree_v2", dst)
    best = max(rates[1:])
    return {"gib_per_second": best, "median": statistics.median(rates[1:]), "seconds": nbytes / common.GIB / best,
            "bytes": nbytes}


def child_main(args: argparse.Namespace) -> int:
    if args.child == "h2d":
        result = child_h2d(args.h2d_size, 5)
    else:
        result = child_raw(args.file, 16, 16 * common.MIB, 0.025, direct=args.child == "raw-direct")
        result["gib_per_second"] = result["bytes"] / common.GIB / result["seconds"]
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


def run_child(argv: list[str], timeout: float) -> tuple[dict[str, Any], float, float]:
    """(the JSON the child printed, its wall seconds, its CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK) or line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{' '.join(argv)} printed no result: {done.stdout[-2000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_MARK)), wall, cpu


def measure(row: str, cache: str, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """One run of ``row`` with the page cache ``cache``."""
    if row != "h2d":
        common.evict(cli=args.cli, path=path) if cache == "cold" else common.warm(path)
    cached = common.resident_bytes(path) / path.stat().st_size
    if row == "dmaload":
        report, wall, cpu = run_child([args.cli, "load", str(path), "--to", args.device, "--json"], args.timeout)
        rate, load_seconds = report["gib_per_second"], report["total_seconds"]
    else:
        me = [sys.executable, __file__, "--child", row, "--file", str(path), "--h2d-size", str(args.h2d_size)]
        result, wall, cpu = run_child(me, args.timeout)
        rate, load_seconds = result["gib_per_second"], result.get("seconds", wall)
    return {"row": row, "cache": cache, "gib_per_second": rate, "seconds": load_seconds, "wall": wall,
            "cpu": cpu, "cached_before": cached}


def median(runs: list[dict[str, Any]], row: str, cache: str, key: str) -> float | None:
    values = [r[key] for r in runs if r["row"] == row and r["cache"] == cache]
    return statistics.median(values) if values else None


def report(runs: list[dict[str, Any]], size: int, caches: list[str]) -> str:
    out = [f"file {size / common.GIB:.2f} GiB, {len({r['row'] for r in runs})} rows, medians of "
           f"{max(1, len(runs) // max(1, len({(r['row'], r['cache']) for r in runs})))} round(s)", "",
           f"| {'row':<13}| {'cache':<6}| {'GiB/s':>7} | {'load s':>7} | {'process s':>9} | {'CPU s':>6} |",
           f"|{'-' * 14}|{'-' * 7}|{'-' * 9}|{'-' * 9}|{'-' * 11}|{'-' * 8}|"]
    for cache in caches:
        for row in ROWS:
            rate = median(runs, row, cache, "gib_per_second")
            if rate is None or (row == "h2d" and cache != caches[0]):
                continue
            out.append(f"| {row:<13}| {cache if row != 'h2d' else '-':<6}| {rate:>7.2f} | "
                       f"{median(runs, row, cache, 'seconds'):>7.3f} | {median(runs, row, cache, 'wall'):>9.3f} | "
                       f"{median(runs, row, cache, 'cpu'):>6.2f} |")
    out.append("")
    h2d = median(runs, "h2d", caches[0], "gib_per_second")
    if "cold" in caches:
        best = max(filter(None, [median(runs, r, "cold", "gib_per_second") for r in ("raw-direct", "raw-buffered")]),
                   default=None)
        ours = median(runs, "dmaload", "cold", "gib_per_second")
        if best and ours:
            out.append(f"cold: dmaload / best raw read {ours / best:.2f} (target >= 1.0)")
    if "warm" in caches and h2d:
        ours = median(runs, "dmaload", "warm", "gib_per_second")
        if ours:
            out.append(f"warm: dmaload / pinned H2D {ours / h2d:.2f} (target >= 0.8)")
    for cache in caches:
        load, wall = median(runs, "dmaload", cache, "seconds"), median(runs, "dmaload", cache, "wall")
        if load and wall:
            out.append(f"{cache}: dmaload's process took {wall:.3f} s for a {load:.3f} s load "
                       f"({wall - load:.3f} s of start-up and set-up)")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", default=os.environ.get("DMALOAD_CLI", "dmaload"), help="the dmaload CLI")
    parser.add_argument("--file", type=Path, help="load this file instead of a generated model")
    parser.add_argument("--size", type=common.parse_size, default=4 * common.GIB, help="generated model size (4G)")
    parser.add_argument("--dir", type=Path, default=None, help="where the generated model goes (.dev/)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", default="cold,warm")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--h2d-size", type=common.parse_size, default=common.GIB)
    parser.add_argument("--timeout", type=float, default=120, help="seconds each child may take")
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument("--child", choices=["raw-direct", "raw-buffered", "h2d"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    caches = [c for c in args.cache.split(",") if c]
    rows = [r for r in args.rows.split(",") if r]
    if unknown := set(rows) - set(ROWS) or set(caches) - {"cold", "warm"}:
        parser.error(f"unknown row or cache state: {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(dir=args.dir or common.ROOT / ".dev", prefix="gpu-core-") as tmp:
        path = args.file
        if path is None:
            path = Path(tmp) / "model.safetensors"
            config, tensors = common.write_model(path, args.size)
            common.log(f"generated {path} ({config}, {tensors} tensors)")
        runs: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            order = rows if round_ % 2 == 0 else rows[::-1]
            for cache in caches:
                for row in order:
                    if row == "h2d" and cache != caches[0]:
                        continue  # no cache state: once a round
                    runs.append(measure(row, cache, args, path))
                    common.log(f"round {round_ + 1} {cache} {row}: {runs[-1]['gib_per_second']:.2f} GiB/s")
        print(report(runs, path.stat().st_size, caches))
        if args.json:
            args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
