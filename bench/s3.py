"""Loads one S3 object into host memory with dmaload and, where installed,
boto3's transfer manager, on the same server in the same run; prints GiB/s
and client CPU seconds per GiB (on loopback the server shares the cores, so
CPU per GiB decides the ranking: both are reported). Not a test.

    AWS_ENDPOINT_URL=http://127.0.0.1:3900 AWS_REGION=garage \\
    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    python bench/s3.py s3://models/model.bin [--runs 3]
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import time
from collections.abc import Callable


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(name: str, size: int, runs: int, load: Callable[[], int]) -> None:
    for run in range(runs):
        cpu, wall = cpu_seconds(), time.perf_counter()
        got = load()
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        assert got == size, f"{name} loaded {got} of {size} bytes"
        gib = size / (1 << 30)
        print(f"{name:<28} run {run + 1}: {gib / wall:6.2f} GiB/s  {cpu / gib:6.2f} CPU s/GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="s3://BUCKET/KEY")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    bucket, key = args.url.removeprefix("s3://").split("/", 1)

    import dmaload

    buffer = dmaload.load(args.url)
    size = len(buffer)
    del buffer
    measure("dmaload", size, args.runs, lambda: len(dmaload.load(args.url)))

    try:
        import boto3
        from boto3.s3.transfer import TransferConfig
    except ImportError:
        print("boto3: not installed (pip install boto3)")
        return
    from botocore.config import Config

    # The region and addressing dmaload uses (docs/object-storage.md): botocore
    # reads AWS_DEFAULT_REGION, not AWS_REGION, and a custom endpoint such as
    # Garage's answers path-style requests only.
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    style = os.environ.get("DMALOAD_S3_ADDRESSING") or ("path" if endpoint else "virtual")
    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name=region, config=Config(s3={"addressing_style": style})
    )
    for concurrency in (10, 32):
        config = TransferConfig(max_concurrency=concurrency, multipart_chunksize=8 << 20)

        def boto() -> int:
            out = io.BytesIO()
            client.download_fileobj(bucket, key, out, Config=config)
            return out.getbuffer().nbytes

        measure(f"boto3 (concurrency {concurrency})", size, args.runs, boto)


if __name__ == "__main__":
    main()
