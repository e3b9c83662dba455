"""``dmaload.load("s3://...")`` against a real S3 server: a single-node
Garage on 127.0.0.1 started per module (generated config in a temporary
directory, a bucket and a key), objects uploaded with a signed PUT. Garage
is found through ``$DMALOAD_GARAGE``, else
``~/.cache/dmaload/garage-2.5.0/bin/garage``, else ``garage`` on the PATH;
without it the tests are skipped (SKIP)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dmaload

BUCKET = "models"


def garage_binary() -> str | None:
    given = os.environ.get("DMALOAD_GARAGE")
    if given:
        return given if os.path.isfile(given) else None
    cached = Path.home() / ".cache/dmaload/garage-2.5.0/bin/garage"
    if cached.is_file():
        return str(cached)
    return shutil.which("garage")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Garage:
    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.config = directory / "garage.toml"
        self.s3_port = free_port()
        rpc = free_port()
        self.config.write_text(
            f'metadata_dir = "{directory}/meta"\ndata_dir = "{directory}/data"\ndb_engine = "sqlite"\n'
            f'replication_factor = 1\nrpc_bind_addr = "127.0.0.1:{rpc}"\n'
            f'rpc_public_addr = "127.0.0.1:{rpc}"\nrpc_secret = "{secrets.token_hex(32)}"\n\n'
            f'[s3_api]\ns3_region = "garage"\napi_bind_addr = "127.0.0.1:{self.s3_port}"\n'
        )
        log = open(directory / "garage.log", "wb")
        self.process = subprocess.Popen([binary, "-c", str(self.config), "server"], stdout=log, stderr=log)
        # Up once `garage status` reaches it over RPC (as Garage's own tests wait).
        deadline = time.monotonic() + 60
        while subprocess.run([binary, "-c", str(self.config), "status"], capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, "garage did not start: " + (directory / "garage.log").read_text()
            time.sleep(0.2)
        node = self.cli("node", "id", "-q").strip().split("@")[0]
        self.cli("layout", "assign", "-z", "dc1", "-c", "1G", node)
        self.cli("layout", "apply", "--version", "1")
        self.cli("bucket", "create", BUCKET)
        key = json.loads(self.cli("json-api", "CreateKey", '{"name":"dmaload"}'))
        self.access_key: str = key["accessKeyId"]
        self.secret_key: str = key["secretAccessKey"]
        self.cli("bucket", "allow", "--read", "--write", "--owner", BUCKET, "--key", "dmaload")

    def cli(self, *args: str) -> str:
        return subprocess.run(
            [self.binary, "-c", str(self.config), *args], check=True, capture_output=True, text=True
        ).stdout

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.s3_port}",
            "AWS_REGION": "garage",
        }

    def put(self, key: str, body: bytes) -> None:
        """One PUT signed with AWS Signature V4 (stdlib hmac/hashlib)."""
        host = f"127.0.0.1:{self.s3_port}"
        path = f"/{BUCKET}/{key}"
        deadline = time.monotonic() + 30
        while True:
            now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            payload = hashlib.sha256(body).hexdigest()
            headers = {
                "content-length": str(len(body)),
                "host": host,
                "x-amz-content-sha256": payload,
                "x-amz-date": now,
            }
            names = ";".join(sorted(headers))
            canonical = "\n".join(
                ["PUT", path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)), "", names, payload]
            )
            scope = f"{now[:8]}/garage/s3/aws4_request"
            to_sign = f"AWS4-HMAC-SHA256\n{now}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
            signing = ("AWS4" + self.secret_key).encode()
            for part in (now[:8], "garage", "s3", "aws4_request"):
                signing = hmac.new(signing, part.encode(), hashlib.sha256).digest()
            signature = hmac.new(signing, to_sign.encode(), hashlib.sha256).hexdigest()
            headers["authorization"] = (
                f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                f"SignedHeaders={names}, Signature={signature}"
            )
            connection = http.client.HTTPConnection("127.0.0.1", self.s3_port)
            try:
                connection.request("PUT", path, body=body, headers=headers)
                response = connection.getresponse()
                status, text = response.status, response.read()
            except OSError as e:
                status, text = 0, str(e).encode()
            finally:
                connection.close()
            if status == 200:
                return
            assert time.monotonic() < deadline, f"PUT {key}: {status} {text!r}"
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def garage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Garage]:
    binary = garage_binary()
    if binary is None:
        print("SKIP test_object_store: no garage binary (set DMALOAD_GARAGE; see docs/object-storage.md)")
        pytest.skip("no garage binary")
    server = Garage(binary, tmp_path_factory.mktemp("garage"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(garage: Garage, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Garage:
    """The server's settings in the environment, and no ~/.aws of the
    machine's."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, value in garage.env().items():
        monkeypatch.setenv(name, value)
    return garage


def test_load_reads_an_s3_url_bit_exact(s3_env: Garage) -> None:
    body = os.urandom((6 << 20) + 11)
    s3_env.put("llama/model.bin", body)
    calls: list[tuple[int, int]] = []
    buffer = dmaload.load("s3://models/llama/model.bin", progress=lambda d, t: calls.append((d, t)))
    assert bytes(buffer) == body
    assert calls[-1] == (len(body), len(body))
    assert bytes(dmaload.load_range("s3://models/llama/model.bin", 12345, 1 << 20)) == body[12345 : 12345 + (1 << 20)]


def test_a_missing_object_is_file_not_found_and_wrong_keys_permission_error(
    s3_env: Garage, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FileNotFoundError, match="HTTP 404"):
        dmaload.load("s3://models/no/such/key")
    s3_env.put("small.bin", b"x" * 100)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-0123456789")
    with pytest.raises(PermissionError, match="HTTP 403") as raised:
        dmaload.load("s3://models/small.bin")
    assert "wrong-secret" not in str(raised.value) and s3_env.secret_key not in str(raised.value)
