"""What a serving engine's weight loading costs the reader, outside the
engine: each tensor of a checkpoint is copied into a parameter allocated
(and touched) beforehand, as ``model.load_weights`` does, from

- ``safetensors``: safetensors' own ``safe_open`` (a mapping of the file,
  read by the kernel's readahead: vLLM's default loader), and
- ``dmaload``: ``dmaload.safetensors.iter_tensors(..., recycle=True)`` (what
  the vLLM and SGLang loaders iterate), with any ``--variant NAME=JSON`` of
  its keyword arguments (``'w16={"window": "16M"}'``) as a format of its own.

Each run is a fresh process, the files evicted (cold) or read whole
(warm) first; formats alternate within each round. Reported per format
and state, median (range): seconds, CPU seconds of the process (every
thread), minor faults, and how far the resident set grew (the window
buffers: the parameters exist before).

    python bench/stream.py [--model DIR] [--rounds 4] [--states cold,warm]
        [--engine-work-ms 5] [--build-ms 150] [--cpus 1]

``--engine-work-ms`` adds an engine's per-weight Python, ``--build-ms`` its
model build before the first tensor (dmaload's read begins before it, as
its vLLM loader's does), ``--cpus 1`` the pinning of vLLM's CPU build
(each rank's worker, every thread of it, on one CPU).

Not a test: compare within a run (this VM swings 2x within minutes). The
model is bench/serving.py's generated Llama (made there if absent)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from serving import make_model, set_cache  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def engine_work(seconds: float) -> None:
    """Pure Python for ``seconds`` (it holds the GIL, as an engine's
    per-weight Python does)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        sum(i * i for i in range(200))


def run_one(
    model: Path, fmt: str, state: str, kwargs: dict[str, Any], work_ms: float, build_ms: float = 0.0
) -> dict[str, float]:
    """One load in this process: the measurement ``main`` runs in a child."""
    import torch
    from safetensors import safe_open

    from dmaload.safetensors import iter_tensors
    from dmaload.safetensors._collective import Stream

    torch.set_num_threads(1)
    files = sorted(model.glob("*.safetensors"))
    params = {}
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                params[k] = torch.zeros(s.get_shape(), dtype=torch.bfloat16)
    set_cache(model, state)

    def mapped():
        for f in files:
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    yield k, h.get_tensor(k)

    rss = _rss()
    grew = 0
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    if fmt == "safetensors":
        tensors: Any = mapped()
    elif build_ms:
        # As the vLLM loader does (dmaload.engines start_early): the read
        # begins before the model is built, in the buffers the iteration uses.
        options = dict(kwargs)
        tensors = Stream(files, None, "cpu", recycle=True, window=options.pop("window", None), options=options)
        tensors.start()
    else:
        tensors = iter_tensors(files, "cpu", recycle=True, **kwargs)
    engine_work(build_ms / 1000)
    for i, (name, t) in enumerate(tensors):
        engine_work(work_ms / 1000)
        params[name].copy_(t)
        if i % 8 == 0:
            grew = max(grew, _rss() - rss)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"s": seconds, "cpu_s": cpu, "faults": after.ru_minflt - before.ru_minflt, "rss_mib": grew / 2**20}


def median_range(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / ".dev" / "serving-model")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--states", default="cold,warm")
    ap.add_argument("--formats", default="safetensors,dmaload")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON")
    ap.add_argument("--engine-work-ms", type=float, default=0.0,
                    help="pure Python per tensor before its copy, as an engine's weight loader spends "
                         "(vLLM's CPU build: about 5 ms a tensor for this model)")
    ap.add_argument("--build-ms", type=float, default=0.0,
                    help="pure Python before the first tensor, timed with the load, as an engine builds its "
                         "model first; dmaload's read begins before it, as its vLLM loader's does")
    ap.add_argument("--cpus", type=int, default=0,
                    help="run each load on this many CPUs only (vLLM's CPU build pins its worker, every "
                         "thread of it, to one CPU per rank); 0: all")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.cpus:
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: a.cpus])
        fmt, state, kwargs = a.child
        print(json.dumps(run_one(a.model, fmt, state, json.loads(kwargs), a.engine_work_ms, a.build_ms)))
        return
    make_model(a.model, 1.1, "300MB")  # bench/serving.py's defaults
    variants: dict[str, dict[str, Any]] = {f: {} for f in a.formats.split(",")}
    for v in a.variant:
        name, _, config = v.partition("=")
        variants[f"dmaload:{name}"] = json.loads(config)
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd in range(a.rounds):
        for state in a.states.split(","):
            names = list(variants)
            for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                fmt = "safetensors" if name == "safetensors" else "dmaload"
                out = subprocess.run(
                    [sys.executable, __file__, "--model", str(a.model), "--engine-work-ms", str(a.engine_work_ms),
                     "--cpus", str(a.cpus), "--build-ms", str(a.build_ms),
                     "--child", fmt, state, json.dumps(variants[name])],
                    capture_output=True, text=True, check=True,
                )
                r = json.loads(out.stdout.strip().splitlines()[-1])
                runs.setdefault((name, state), []).append(r)
                print(json.dumps({"format": name, "state": state, "round": rnd, **r}), file=sys.stderr, flush=True)
    total = sum(p.stat().st_size for p in a.model.glob("*.safetensors"))
    cpus = a.cpus or len(os.sched_getaffinity(0))
    print(f"\nmodel: {a.model} ({total / 2**30:.2f} GiB); {a.rounds} round(s); each load on {cpus} of "
          f"{len(os.sched_getaffinity(0))} CPUs; "
          f"{a.engine_work_ms} ms of Python per tensor, {a.build_ms} ms before the first")
    print("| format | state | seconds | CPU seconds | minor faults | resident set grew, MiB |")
    print("|---|---|---|---|---|---|")
    for (name, state), rs in runs.items():
        print(f"| {name} | {state} | {median_range([r['s'] for r in rs])} | {median_range([r['cpu_s'] for r in rs])} | "
              f"{median_range([r['faults'] for r in rs], 0)} | {median_range([r['rss_mib'] for r in rs], 0)} |")


if __name__ == "__main__":
    main()
