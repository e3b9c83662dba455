"""The Python implementation of the dmaload command line (see ``__main__``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, get_args

from . import _dmaload
from ._load import load_range
from ._options import DEVICE_DESTINATIONS, Destination, Engine, Mode, parse_size
from ._report import LoadReport

# Subcommands only the Python implementation has.
PYTHON_ONLY = frozenset({"tensors"})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dmaload",
        description="Load huge files into DMA-shareable memory at the speed of the disk "
        "(Python implementation: the native dmaload CLI was not found).",
    )
    p.add_argument("--version", action="version", version=f"dmaload {_dmaload.__version__} (python)")
    sub = p.add_subparsers(dest="command", required=True)
    ld = sub.add_parser("load", help="allocate a buffer and fill it with a file (or a byte range of it)")
    ld.add_argument("file")
    ld.add_argument("--offset", type=parse_size, default=0, help="first byte to load")
    ld.add_argument("--length", type=parse_size, default=None, help="bytes to load (default: to the end)")
    ld.add_argument("--engine", choices=get_args(Engine), default=None)
    ld.add_argument("--mode", choices=get_args(Mode), default=None)
    ld.add_argument("--direct", action="store_true", help="require direct I/O (same as --mode direct)")
    ld.add_argument(
        "--to",
        choices=get_args(Destination),
        default=None,
        help=f"host memory the bytes go to ({', '.join(DEVICE_DESTINATIONS)} needs the native dmaload CLI)",
    )
    ld.add_argument("--gather-size", type=parse_size, default=None)
    ld.add_argument("--chunk-size", type=parse_size, default=None)
    ld.add_argument("--queue-depth", type=int, default=None)
    ld.add_argument("--threads", type=int, default=None)
    ld.add_argument("--populate-threads", type=int, default=None)
    ld.add_argument(
        "--no-page-cache",
        action="store_true",
        help="skip measuring how much of the range is in the page cache afterwards (the cache line)",
    )
    ld.add_argument("--json", action="store_true", help="print the report as one JSON object")
    ts = sub.add_parser("tensors", help="list the tensors of a safetensors file (header only)")
    ts.add_argument("file")
    ts.add_argument("--json", action="store_true")
    for name in ("info", "demo"):
        sub.add_parser(name, help="(needs the native dmaload CLI)", add_help=False)
    return p


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _load_text(r: LoadReport) -> str:
    lines = [
        f"loaded   {r.bytes} bytes ({_gib(r.bytes)}) of {r.path} from offset {r.offset}",
        f"engine   {r.engine}, cache {r.cache}, memory {r.memory}, filesystem {r.filesystem}",
        f"memory   {r.memory}: {r.memory_reason}",
        f"time     {r.total_seconds:.3f} s ({r.gib_per_second:.2f} GiB/s): alloc {r.alloc_seconds:.3f} s, "
        f"I/O {r.io_seconds:.3f} s, waited for memory {r.waited_for_memory_seconds:.3f} s",
        f"cpu      user {r.cpu_user_seconds:.3f} s, system {r.cpu_system_seconds:.3f} s",
    ]
    if r.page_cache is not None:
        lines.append(
            f"cache    {r.page_cache.resident_bytes} bytes resident after the load ({r.page_cache.fraction:.1%})"
        )
    lines += [f"fallback {f.from_} -> {f.to}: {f.reason}" for f in r.fallbacks]
    return "\n".join(lines) + "\n"


def _cmd_load(a: argparse.Namespace) -> int:
    options: dict[str, Any] = {
        k: v
        for k, v in {
            "engine": a.engine,
            "mode": "direct" if a.direct else a.mode,
            "to": a.to,
            "gather_size": a.gather_size,
            "chunk_size": a.chunk_size,
            "queue_depth": a.queue_depth,
            "threads": a.threads,
            "populate_threads": a.populate_threads,
        }.items()
        if v is not None
    }
    # The report printed shows the page cache, as the native CLI's does.
    options["measure_page_cache"] = not a.no_page_cache
    with load_range(a.file, a.offset, a.length, progress=sys.stderr.isatty(), **options) as buf:
        if a.json:
            print(buf.report_json)
        else:
            sys.stdout.write(_load_text(buf.report))
    return 0


def _cmd_tensors(a: argparse.Namespace) -> int:
    header = _dmaload.read_safetensors_header(a.file)
    if a.json:
        print(
            json.dumps(
                {
                    "data_start": header.data_start,
                    "metadata": header.metadata,
                    "tensors": [
                        {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
                        for t in header.tensors
                    ],
                }
            )
        )
        return 0
    for t in header.tensors:
        print(f"{t.name}\t{t.dtype}\t{list(t.shape)}\t{header.data_start + t.begin}\t{t.nbytes}")
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "bench":
        print(
            "dmaload: error: the benchmarks moved to the dmaload-bench binary "
            "(cargo build --release -p dmaload-bench): run `dmaload-bench "
            + (" ".join(argv[1:]) or "--help")
            + "`",
            file=sys.stderr,
        )
        return 2
    if argv and argv[0] in ("info", "demo"):
        print(
            f"dmaload: error: '{argv[0]}' needs the native dmaload CLI "
            "(cargo install --path crates/dmaload-cli, or set DMALOAD_CLI)",
            file=sys.stderr,
        )
        return 2
    args = _parser().parse_args(argv)
    try:
        if args.command == "load":
            return _cmd_load(args)
        return _cmd_tensors(args)
    except (OSError, _dmaload.SafetensorError) as exc:
        print(f"dmaload: error: {exc}", file=sys.stderr)
        return 1
