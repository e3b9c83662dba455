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
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GIB, MIB, ROOT, evict, log, parse_size, read_header, resident_bytes, warm, write_model  # noqa: E402
from gpu_child import (  # noqa: E402
    ALIASES, CACHE_SOCKET_ENV, DEFAULT_LOADERS, LOADERS, MODULES, RESULT_MARK,
    Unavailable, child_main, parse_opts,
)


# --------------------------------------------------------------------------
# Parent side


def ring_bytes(opts: dict[str, Any]) -> int:
    """The most a device load's staging ring pins: the options' slots, else
    the core's most (unset, the core sizes the ring to the file, up to
    that: dmaload::device::staging_ring_slots)."""
    from dmaload import _dmaload

    most = _dmaload._option_defaults()
    slots = int(opts.get("staging_slots", most["staging_slots"]))
    slot = opts.get("staging_slot_size", most["staging_slot_size"])
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
