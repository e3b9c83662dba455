#!/usr/bin/env python3
"""Verified cold loads against unverified ones, SHA-256 and BLAKE3 side by
side in one run (issue 23's target: a verified cold load at >= 0.8x the
unverified one on the same machine).

FILE is hard-linked into two directories under --dir: one with the
SHA256SUMS and one with the B3SUMS that `dmaload sums` writes (the time to
write them is printed: one read of the file each). Each round then runs
`dmaload-bench load LINK --verified-only --repeat R --json` on both, the
order alternating round by round; that command evicts the page cache
before every load and runs the unverified in-place default and the same
load with `verify` in turn, so each ratio compares two loads of one run.

    python3 bench/verify.py FILE [--rounds 3] [--repeat 3] [--cli target/release/dmaload]
        [--bench target/release/dmaload-bench] [--dir DIR]

Prints each round, then per digest the median GiB/s unverified and
verified and the median ratio with its range.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

DIGESTS = {"SHA-256": "sha256", "BLAKE3": "blake3"}


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cli", default=str(root / "target/release/dmaload"))
    parser.add_argument("--bench", default=str(root / "target/release/dmaload-bench"))
    parser.add_argument("--dir", type=Path, default=None, help="where the two links go (default: beside FILE)")
    args = parser.parse_args()
    base = args.dir or args.file.resolve().parent / ".dmaload-verify-bench"
    links = {}
    try:
        for name, digest in DIGESTS.items():
            directory = base / digest
            directory.mkdir(parents=True, exist_ok=True)
            link = directory / args.file.name
            if link.exists():
                link.unlink()
            os.link(args.file, link)  # the same inode: the same blocks on disk
            started = time.monotonic()
            subprocess.run([args.cli, "sums", "--digest", digest, str(link)], check=True, capture_output=True)
            print(f"dmaload sums --digest {digest}: {time.monotonic() - started:.2f} s", flush=True)
            links[name] = link
        ratios: dict[str, list[float]] = {name: [] for name in DIGESTS}
        plain: dict[str, list[float]] = {name: [] for name in DIGESTS}
        verified: dict[str, list[float]] = {name: [] for name in DIGESTS}
        for r in range(args.rounds):
            order = list(DIGESTS) if r % 2 == 0 else list(reversed(DIGESTS))
            for name in order:
                out = subprocess.run(
                    [args.bench, "load", str(links[name]), "--verified-only", "--repeat", str(args.repeat), "--json"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                rows = json.loads(out)["rows"]
                if len(rows) != 2 or name not in rows[1]["method"]:
                    raise SystemExit(f"unexpected rows: {[row['method'] for row in rows]}")
                unv, ver = (statistics.median(s["gib_per_second"] for s in row["samples"]) for row in rows)
                plain[name].append(unv)
                verified[name].append(ver)
                ratios[name].append(ver / unv)
                print(f"round {r + 1} {name}: unverified {unv:.2f} GiB/s, verified {ver:.2f} GiB/s, {ver / unv:.2f}x", flush=True)
        print()
        print("| digest | unverified GiB/s | verified GiB/s | verified / unverified (range) |")
        print("|---|---:|---:|---:|")
        for name in DIGESTS:
            r = ratios[name]
            print(
                f"| {name} | {statistics.median(plain[name]):.2f} | {statistics.median(verified[name]):.2f} "
                f"| {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) |"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
