#!/usr/bin/env python3
"""vLLM's weight-loading time with dmaload against its other load formats.

Generates a Llama-shaped checkpoint (random bf16 weights, several shards;
tests/engines/tiny_llama.py), then serves it with vLLM once per load format,
rank count and page-cache state, each engine a fresh process
(tests/engines/generate.py), the formats interleaved round by round:

  cold   every shard evicted from the page cache first (dmaload.evict)
  warm   every shard read once first, so that it is in the page cache

Reported per format, ranks and state: vLLM's own "Loading weights took"
(the slowest rank's; runai_streamer's loader prints none: "-"); the model
build and the weights together, vLLM's "Initializing model took" plus
"Loading weights took" (the slowest rank's sum: dmaload begins its read
inside the build, which the first line alone leaves out); the time to the first token from the process's start
(vLLM's import and engine start included), and the bytes read from the
block device holding the checkpoint during the run (/sys/dev/block/.../stat:
the whole machine's reads, since an engine's worker processes are not all
reaped by their parents, whose /proc/self/io would count them; an engine
with dummy weights runs first for each rank count, so that vLLM's own files
are in the page cache and the bytes counted are the checkpoint's). With
dmaload each rank also logs what it read itself. A format whose
engine fails is reported with its error once and not run again. A run
whose tokens differ from the safetensors run's with the same ranks is
marked.

Run with the vLLM environment (tests/engines/setup-vllm.sh; the peers come
with DMALOAD_VLLM_PEERS=1):

    tests/engines/.venv-vllm/bin/python bench/serving.py --rounds 2

``--variant NAME='{"window": "64M"}'`` adds dmaload with another extra
config as its own format (``dmaload:NAME``), interleaved with the rest.

``--formats ...,ipc_cache`` adds vLLM's own restart path (vLLM 0.33 and
later, CUDA build, a GPU: the device kit): one ``vllm preload`` daemon per
rank count holds the weights in GPU memory, started before the first
``ipc_cache`` engine and stopped at the end, and each ``ipc_cache`` engine
maps them from it (``--load-format ipc_cache`` with the daemons' socket
directory). Its page-cache state is irrelevant: the daemon loaded once.
Where no daemon starts (no CUDA build, no GPU, an older vLLM) the row is
reported as not measured, with the daemon's error.

Not a test: absolute numbers depend on the machine; compare within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ROOT / "tests" / "engines"
FORMATS = ["dmaload", "safetensors", "fastsafetensors", "runai_streamer", "instanttensor"]
LOADING = re.compile(r"Loading weights took ([0-9.]+) seconds")
BUILDING = re.compile(r"Initializing model took ([0-9.]+) seconds")
ERROR = re.compile(r"\b\w+Error: ")
NOT_CAUSES = ("Tokenizer not available", "Engine core initialization failed", "Worker failed with error")


def device_read_bytes(model: Path) -> int:
    """Bytes read so far from the block device holding ``model`` (its
    /sys/dev/block/MAJ:MIN/stat, sectors read: the whole machine's reads)."""
    dev = os.stat(model).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    return int(stat[2]) * 512


def make_model(out: Path, size_gib: float, shard: str) -> Path:
    """A Llama with hidden 2048 and as many layers as reach ``size_gib``."""
    if (out / "config.json").exists():
        return out
    sys.path.insert(0, str(ENGINES))
    from tiny_llama import make

    hidden, intermediate, vocab = 2048, 5632, 32000
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * (hidden // 4) + 3 * hidden * intermediate)
    fixed = 2 * 2 * vocab * hidden
    layers = max(1, -(-int(size_gib * 2**30 - fixed) // per_layer))
    print(f"making a {layers}-layer Llama in {out}", file=sys.stderr, flush=True)
    return make(out, layers=layers, hidden=hidden, intermediate=intermediate, vocab=vocab, shard_size=shard)


def shards(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def set_cache(model: Path, state: str) -> None:
    import dmaload

    for p in shards(model):
        if state == "cold":
            dmaload.evict(p)
        else:
            with open(p, "rb") as f:
                while f.read(16 << 20):
                    pass


READY = "Weight cache daemon READY"


class PreloadDaemon:
    """``vllm preload`` for ``model`` on ``ranks`` GPUs, its sockets in a
    directory of its own; ``error`` says why it is not serving."""

    def __init__(self, python: str, model: Path, ranks: int, memory: float, timeout: int) -> None:
        self.socket_dir = tempfile.mkdtemp(prefix="dmaload-preload-")
        self.log = Path(self.socket_dir) / "daemon.log"
        command = [
            python, "-m", "vllm.entrypoints.cli.main", "preload", "--model", str(model),
            "--tensor-parallel-size", str(ranks), "--gpu-memory-utilization", str(memory),
            "--weight-cache-socket-dir", self.socket_dir,
        ]  # fmt: skip
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.error: str | None = None
        deadline = time.monotonic() + timeout
        while READY not in self.log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                lines = self.log.read_text(errors="replace").splitlines()
                errors = [x for x in lines if ERROR.search(x)]
                self.error = "vllm preload: " + (errors[-1] if errors else " | ".join(lines[-3:]) or "no output")[-300:]
                self.stop()
                return
            time.sleep(1)

    @property
    def extra(self) -> str:
        return json.dumps({"socket_dir": self.socket_dir})

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def serve(
    python: str, model: Path, fmt: str, ranks: int, memory: float, timeout: int, extra: str = "{}"
) -> dict[str, object]:
    env = dict(os.environ)
    if ranks > 1:
        cpus = sorted(os.sched_getaffinity(0))[:ranks]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cpus))
    before = device_read_bytes(model)
    started = time.perf_counter()
    run = subprocess.run(
        [python, str(ENGINES / "generate.py"), str(model), fmt, extra, str(ranks), str(memory)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    wall = time.perf_counter() - started
    output = run.stdout + run.stderr
    result: dict[str, object] = {"read": device_read_bytes(model) - before, "wall_s": wall}
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    loads = [float(m) for m in LOADING.findall(output)]
    if run.returncode != 0 or line is None:
        # The root cause, not the engine's "see root cause above".
        errors = [x for x in output.splitlines() if ERROR.search(x) and not any(n in x for n in NOT_CAUSES)]
        result["error"] = (errors[0] if errors else output[-300:]).strip()[-300:]
        return result
    result.update(json.loads(line[len("RESULT ") :]))
    builds = [float(m) for m in BUILDING.findall(output)]
    if loads:  # runai_streamer's loader does not print it
        result["load_s"] = max(loads)
        if len(builds) == len(loads):  # each rank's build + weights, the slowest rank's
            result["build_and_load_s"] = max(b + w for b, w in zip(builds, loads))
    result["dmaload_lines"] = [x.split("dmaload: ", 1)[1] for x in output.splitlines() if "dmaload: loaded" in x]
    return result


OWN_READ = re.compile(r"this process read ([0-9.]+) GiB of the checkpoint")


def own_reads(run: dict[str, object]) -> float:
    """GiB of the checkpoint the dmaload ranks of ``run`` say they read
    (each rank's share of the plan), summed over the ranks."""
    return sum(float(m) for line in run["dmaload_lines"] for m in OWN_READ.findall(line))  # type: ignore[attr-defined]


def median_range(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / ".dev" / "serving-model", help="made there if absent")
    ap.add_argument("--size-gib", type=float, default=1.1)
    ap.add_argument("--shard-size", default="300MB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--ranks", default="1,2", help="tensor-parallel sizes (one CPU each on vLLM's CPU build)")
    ap.add_argument("--states", default="cold,warm")
    ap.add_argument("--memory", type=float, default=0.3,
                    help="vLLM's gpu_memory_utilization: on the CPU build the share of host memory for weights and KV cache")
    ap.add_argument("--timeout", type=int, default=900, help="seconds one engine may take")
    ap.add_argument("--dmaload-config", default="{}",
                    help="dmaload's --model-loader-extra-config (JSON), e.g. '{\"mode\": \"direct\"}'")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="also run dmaload with this extra config, as format dmaload:NAME "
                         "(interleaved with the others; repeatable), e.g. 'w64={\"window\": \"64M\"}'")
    ap.add_argument("--json", type=Path, help="write every run here")
    a = ap.parse_args()
    variants = {"dmaload": a.dmaload_config}
    for v in a.variant:
        name, _, config = v.partition("=")
        json.loads(config)  # a typo fails here, not in every engine
        variants[f"dmaload:{name}"] = config

    model = make_model(a.model, a.size_gib, a.shard_size)
    total = sum(p.stat().st_size for p in shards(model))
    formats = a.formats.split(",") + [v for v in variants if v != "dmaload"]
    ranks = [int(r) for r in a.ranks.split(",") if int(r) <= len(os.sched_getaffinity(0))]
    states = a.states.split(",")
    runs: list[dict[str, object]] = []
    broken: dict[str, str] = {}
    daemons: dict[int, PreloadDaemon] = {}
    # One engine with dummy weights first: vLLM's own files are then in the
    # page cache, so the reads counted below are the checkpoint's.
    for n in ranks:
        serve(sys.executable, model, "dummy", n, a.memory, a.timeout)
    for rnd in range(a.rounds):
        for state in states:
            for n in ranks:
                order = formats[rnd % len(formats) :] + formats[: rnd % len(formats)]
                for fmt in order:
                    if fmt in broken:
                        continue
                    set_cache(model, state)
                    extra = variants.get(fmt, "{}")
                    engine_format = "dmaload" if fmt in variants else fmt
                    if fmt == "ipc_cache":
                        if n not in daemons:
                            daemons[n] = PreloadDaemon(sys.executable, model, n, a.memory, a.timeout)
                        if daemons[n].error is not None:
                            broken[fmt] = str(daemons[n].error)
                            continue
                        extra = daemons[n].extra
                    r = serve(sys.executable, model, engine_format, n, a.memory, a.timeout, extra)
                    r.update(format=fmt, ranks=n, state=state, round=rnd)
                    runs.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), file=sys.stderr, flush=True)
                    if "error" in r:
                        broken[fmt] = str(r["error"])
    for daemon in daemons.values():
        daemon.stop()
    if a.json:
        a.json.write_text(json.dumps({"model_bytes": total, "runs": runs}, indent=1))

    print(f"\nmodel: {len(shards(model))} shards, {total / 2**30:.2f} GiB; {a.rounds} round(s); machine: "
          f"{os.cpu_count()} CPUs; dmaload's extra configs: {variants}")
    print("| format | ranks | state | Loading weights took, s | model build + weights, s "
          "| first token from start, s | device reads, GiB | dmaload ranks' own reads, x checkpoint | tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in formats:
        if fmt in broken:
            continue
        for n in ranks:
            for state in states:
                mine = [r for r in runs if (r["format"], r["ranks"], r["state"]) == (fmt, n, state) and "error" not in r]
                reference = [r["tokens"] for r in runs if (r["format"], r["ranks"]) == ("safetensors", n) and "tokens" in r]
                same = ("same" if all(r["tokens"] == reference[0] for r in mine) else "DIFFER") if reference else "-"
                reads = [int(r["read"]) / 2**30 for r in mine]  # type: ignore[call-overload]
                own = [own_reads(r) * 2**30 / total for r in mine if r.get("dmaload_lines")]
                print(
                    f"| {fmt} | {n} | {state} | {median_range([float(r['load_s']) for r in mine if 'load_s' in r])} | "  # type: ignore[arg-type]
                    f"{median_range([float(r['build_and_load_s']) for r in mine if 'build_and_load_s' in r])} | "  # type: ignore[arg-type]
                    f"{median_range([float(r['first_token_s']) for r in mine])} | "  # type: ignore[arg-type]
                    f"{median_range(reads)} | {median_range(own)} | {same} |"
                )
    for fmt, error in broken.items():
        print(f"\n{fmt}: not measured: {error}")


if __name__ == "__main__":
    main()
