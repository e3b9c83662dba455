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
import sys
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from pathlib import Path

import pytest

import dmaload
import dmaload.safetensors

if TYPE_CHECKING:
    import torch

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


def _tensors(seed: int, names: list[str]) -> dict[str, "torch.Tensor"]:
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = [(1 << 20,), (33, 7), (0,), (5, 3, 2)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    return {
        name: (torch.rand(shapes[i % 4], generator=g) * 1000).to(dtypes[i % 4]) for i, name in enumerate(names)
    }


def _assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    import torch

    assert list(got) and sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name


def test_safetensors_load_file_reads_one_object_bit_exact(s3_env: Garage, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    import numpy as np

    from dmaload.safetensors import numpy as dl_numpy
    from dmaload.safetensors import torch as dl_torch

    path = tmp_path / "model.safetensors"
    st_torch.save_file(_tensors(1, ["embed", "q", "empty", "ids"]), path, metadata={"format": "pt"})
    s3_env.put("one/model.safetensors", path.read_bytes())
    expected = st_torch.load_file(path)
    calls: list[tuple[int, int]] = []
    got = dl_torch.load_file("s3://models/one/model.safetensors", progress=lambda d, t: calls.append((d, t)))
    _assert_same(got, expected)
    assert calls[-1] == (path.stat().st_size, path.stat().st_size)
    # The views keep the buffer alive after the dict's other tensors go.
    embed = got.pop("embed")
    del got
    assert torch.equal(embed, expected["embed"])
    # A prefix with no index and one model.safetensors, as a directory.
    _assert_same(dl_torch.load_file("s3://models/one/"), expected)
    arrays = dl_numpy.load_file("s3://models/one/model.safetensors")
    assert np.array_equal(arrays["ids"], expected["ids"].numpy())
    with dmaload.safetensors.safe_open("s3://models/one/model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.reports[0].bytes == path.stat().st_size


def _put_sharded(s3_env: Garage, tmp_path: Path, prefix: str) -> dict[str, Any]:
    """Two shards and their index under ``prefix``; the tensors, as
    ``safetensors.torch`` reads them back from the files on disk."""
    st_torch = pytest.importorskip("safetensors.torch")
    layout = {"model-00001-of-00002.safetensors": ["a", "b", "c"], "model-00002-of-00002.safetensors": ["d", "e"]}
    weight_map: dict[str, str] = {}
    expected: dict[str, Any] = {}
    for i, (name, tensors) in enumerate(layout.items()):
        st_torch.save_file(_tensors(10 + i, tensors), tmp_path / name)
        s3_env.put(f"{prefix}/{name}", (tmp_path / name).read_bytes())
        expected |= st_torch.load_file(tmp_path / name)
        weight_map |= dict.fromkeys(tensors, name)
    index = json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode()
    s3_env.put(f"{prefix}/model.safetensors.index.json", index)
    return expected


def test_safetensors_load_file_reads_a_sharded_model_by_prefix_bit_exact(s3_env: Garage, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    expected = _put_sharded(s3_env, tmp_path, "sharded")
    _assert_same(dmaload.safetensors.load_file("s3://models/sharded/", framework="pt"), expected)
    _assert_same(
        dmaload.safetensors.load_file("s3://models/sharded/model.safetensors.index.json", framework="pt"), expected
    )


def test_a_missing_shard_or_prefix_is_file_not_found_naming_the_url(s3_env: Garage, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _put_sharded(s3_env, tmp_path, "broken")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "z": "model-00009-of-00009.safetensors"}}
    s3_env.put("broken/model.safetensors.index.json", json.dumps(index).encode())
    missing = "s3://models/broken/model-00009-of-00009.safetensors"
    with pytest.raises(FileNotFoundError, match=f"mapped to shard 'model-00009.*does not exist: '{missing}'"):
        dmaload.safetensors.load_file("s3://models/broken/", framework="pt")
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json and no model.safetensors under this prefix: 's3://models/nowhere/'"):
        dmaload.safetensors.load_file("s3://models/nowhere/", framework="pt")


def test_a_shard_replaced_mid_load_is_changed_and_a_bad_header_a_safetensor_error(
    s3_env: Garage, tmp_path: Path
) -> None:
    import errno

    pytest.importorskip("torch")
    _put_sharded(s3_env, tmp_path, "moving")
    second = (tmp_path / "model-00002-of-00002.safetensors").read_bytes()
    replaced: list[bool] = []

    def replace_the_second_shard(done: int, total: int) -> None:
        # Called while the first shard loads, after every shard's HEAD.
        if not replaced:
            replaced.append(True)
            s3_env.put("moving/model-00002-of-00002.safetensors", second[:-4] + b"\xff" * 4)

    with pytest.raises(OSError, match="HTTP 412") as raised:
        dmaload.safetensors.load_file("s3://models/moving/", framework="pt", progress=replace_the_second_shard)
    assert raised.value.errno == errno.ESTALE and replaced

    bad = bytearray((tmp_path / "model-00001-of-00002.safetensors").read_bytes())
    bad[8] = ord("[")  # the header's JSON is no object
    (tmp_path / "bad.safetensors").write_bytes(bad)
    s3_env.put("bad/model.safetensors", bytes(bad))
    with pytest.raises(dmaload.SafetensorError) as from_file:
        dmaload.safetensors.load_file(tmp_path / "bad.safetensors", framework="pt")
    with pytest.raises(dmaload.SafetensorError) as from_object:
        dmaload.safetensors.load_file("s3://models/bad/model.safetensors", framework="pt")
    assert str(from_object.value) == str(from_file.value).replace(
        str(tmp_path / "bad.safetensors"), "s3://models/bad/model.safetensors"
    )


def test_safetensors_load_file_of_an_s3_model_takes_the_staged_device_path(s3_env: Garage, tmp_path: Path) -> None:
    """``device=`` for an ``s3://`` model goes through the staged path of a
    file (``_device.load_files``: each shard's header read with a ranged
    GET, then its data section received into the pinned ring and copied to
    the device): bit-exact with ``device="cpu"``, which runs every part of
    that path into host tensors, and on a GPU where PyTorch has one. Where
    PyTorch sees no CUDA device, ``cuda:0`` is PyTorch's refusal, no longer
    "host memory only"."""
    torch = pytest.importorskip("torch")
    from dmaload.safetensors import _device

    expected = _put_sharded(s3_env, tmp_path, "staged")
    shards = [f"s3://models/staged/model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    files = _device.load_files(shards, "cpu", None, {})
    _assert_same({name: f.tensor(name, "pt") for f in files for name in f.tensors}, expected)
    assert [f.path for f in files] == shards
    if torch.cuda.is_available():
        got = dmaload.safetensors.load_file("s3://models/staged/", framework="pt", device="cuda:0")
        _assert_same({name: t.cpu() for name, t in got.items()}, expected)
    else:
        with pytest.raises(RuntimeError, match="PyTorch sees no CUDA device"):
            dmaload.safetensors.load_file("s3://models/staged/", framework="pt", device="cuda:0")
    with pytest.raises(ValueError, match="does not take verify=True with device="):
        dmaload.safetensors.load_file("s3://models/staged/", framework="pt", device="cuda:0", verify=True)


# The child of the emulator test: each shard URL in argv is opened by the
# core (a HEAD, then its header with a ranged GET) and its data section
# received into emulated device memory through the staging ring; prints OK
# when every shard's device bytes are its data section, else the error.
EMULATED_CHILD = r"""
import ctypes, os, struct, sys
from dmaload import _dmaload

cuda = ctypes.CDLL(os.environ["DMALOAD_LIBCUDA"])
def check(code):
    assert code == 0, code
check(cuda.cuInit(0))
device, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cuda.cuDeviceGet(ctypes.byref(device), 0))
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
check(cuda.cuCtxPushCurrent_v2(ctx))
urls, bodies = sys.argv[1::2], [open(p, "rb").read() for p in sys.argv[2::2]]
files = [_dmaload.open_safetensors(url) for url in urls]
pointers = []
for f in files:
    dptr = ctypes.c_ulonglong()
    check(cuda.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(f.data_len)))
    pointers.append(dptr.value)
try:
    reports = _dmaload._load_staged(files, pointers, 0)
except OSError as err:
    print("ERROR", err.errno, err)
    sys.exit(0)
for f, body, dptr, report in zip(files, bodies, pointers, reports):
    start = 8 + struct.unpack("<Q", body[:8])[0]
    back = ctypes.create_string_buffer(f.data_len)
    check(cuda.cuMemcpyDtoH_v2(back, ctypes.c_ulonglong(dptr), ctypes.c_size_t(f.data_len)))
    print("OK" if back.raw == body[start:] else "DIFFERENT", f.path, report.destination)
"""


def test_s3_shards_reach_emulated_device_memory_bit_exact(
    s3_env: Garage, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``_load_staged`` of object shards (what ``load_file("s3://...",
    device="cuda:N")`` runs after PyTorch allocates the device memory) to
    device pointers of the CUDA driver emulator in strict mode: each
    shard's data section bit-exact on the device, through a ring of the
    core's size for objects (``object_ring_slots``: 6 x 16 MiB)."""
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        print("SKIP test_s3_shards_reach_emulated_device_memory_bit_exact: no C compiler for the CUDA emulator")
        pytest.skip("no C compiler")
    pytest.importorskip("torch")
    emulator = tmp_path_factory.mktemp("cuda-emu")
    root = Path(__file__).resolve().parents[3]
    subprocess.run(["bash", str(root / "tests/cuda-emu/build.sh"), str(emulator)], check=True)
    _put_sharded(s3_env, tmp_path, "emulated")
    args = []
    for i in (1, 2):
        name = f"model-0000{i}-of-00002.safetensors"
        args += [f"s3://models/emulated/{name}", str(tmp_path / name)]
    env = dict(os.environ, DMALOAD_LIBCUDA=str(emulator / "libcuda.so.1"), DMALOAD_EMU_STRICT="1")
    out = subprocess.run(
        [sys.executable, "-c", EMULATED_CHILD, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("OK s3://models/emulated/") for line in lines), out.stdout
    assert all("staging ring (6 x 16777216 bytes)" in line for line in lines), out.stdout


def test_verify_checks_objects_against_the_sums_object_beside_them(s3_env: Garage, tmp_path: Path) -> None:
    """``verify=True`` for ``s3://``: ``dmaload.load`` and ``load_file`` of a
    sharded model check each object against the ``SHA256SUMS``/``B3SUMS``
    object under its key's "directory", as a file's sums file; a mismatch
    is ``OSError`` EBADMSG (nothing returned), no sums object the file's
    error (EINVAL)."""
    import errno

    pytest.importorskip("torch")
    body = os.urandom((3 << 20) + 5)
    s3_env.put("sums/blob.bin", body)
    with pytest.raises(OSError, match="no B3SUMS or SHA256SUMS beside it") as missing:
        dmaload.load("s3://models/sums/blob.bin", verify=True)
    assert missing.value.errno == errno.EINVAL
    s3_env.put("sums/SHA256SUMS", f"{hashlib.sha256(body).hexdigest()}  blob.bin\n".encode())
    assert bytes(dmaload.load("s3://models/sums/blob.bin", verify=True)) == body
    s3_env.put("sums/SHA256SUMS", f"{hashlib.sha256(body[1:]).hexdigest()}  blob.bin\n".encode())
    with pytest.raises(OSError, match="SHA-256 mismatch") as mismatch:
        dmaload.load("s3://models/sums/blob.bin", verify=True)
    assert mismatch.value.errno == errno.EBADMSG

    expected = _put_sharded(s3_env, tmp_path, "vsharded")
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    sums = "".join(f"{hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    s3_env.put("vsharded/SHA256SUMS", sums.encode())
    _assert_same(dmaload.safetensors.load_file("s3://models/vsharded/", framework="pt", verify=True), expected)
    s3_env.put("vsharded/SHA256SUMS", sums.replace(sums[:8], "00000000").encode())
    with pytest.raises(OSError, match="SHA-256 mismatch"):
        dmaload.safetensors.load_file("s3://models/vsharded/", framework="pt", verify=True)


def test_iter_tensors_streams_an_s3_model_shard_by_shard(s3_env: Garage, tmp_path: Path) -> None:
    """``iter_tensors("s3://...")``: every tensor bit-exact, in shard and
    data order, each shard loaded only once the previous one's tensors are
    handed out (a shard replaced after the first tensor came is ESTALE:
    its headers were checked, its data not yet read); what it cannot take
    for an object is a ValueError naming it."""
    import errno

    pytest.importorskip("torch")
    expected = _put_sharded(s3_env, tmp_path, "streamed")
    got = list(dmaload.safetensors.iter_tensors("s3://models/streamed/"))
    names = [name for name, _ in got]
    assert sorted(names[:3]) == ["a", "b", "c"] and sorted(names[3:]) == ["d", "e"], names
    _assert_same(dict(got), expected)

    second = (tmp_path / "model-00002-of-00002.safetensors").read_bytes()
    stream = dmaload.safetensors.iter_tensors("s3://models/streamed/model.safetensors.index.json")
    first = next(stream)
    s3_env.put("streamed/model-00002-of-00002.safetensors", second[:-4] + b"\xff" * 4)
    with pytest.raises(OSError, match="HTTP 412") as raised:
        list(stream)
    assert raised.value.errno == errno.ESTALE
    assert first[0] in ("a", "b", "c")


def test_a_verified_stream_of_an_s3_model_hashes_every_object_against_its_sums_object(
    s3_env: Garage, tmp_path: Path
) -> None:
    """``iter_tensors("s3://...", verify=True)``, and a filtered
    ``load_file``: the stream's windows cover every byte of each object,
    hashed against the ``SHA256SUMS`` object beside it; no sums object is
    the file's error (EINVAL) before any tensor, a digest that differs is a
    ``CollectiveLoadError`` before the shard's tensors."""
    import errno

    pytest.importorskip("torch")
    expected = _put_sharded(s3_env, tmp_path, "vstream")
    with pytest.raises(OSError, match="no B3SUMS or SHA256SUMS beside it") as missing:
        next(dmaload.safetensors.iter_tensors("s3://models/vstream/", verify=True))
    assert missing.value.errno == errno.EINVAL
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    sums = "".join(f"{hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    s3_env.put("vstream/SHA256SUMS", sums.encode())
    _assert_same(dict(dmaload.safetensors.iter_tensors("s3://models/vstream/", verify=True, window="64K")), expected)
    wanted = {"b", "d"}
    filtered = dmaload.safetensors.load_file("s3://models/vstream/", framework="pt", tensor_filter=wanted, verify=True)
    _assert_same(filtered, {k: v for k, v in expected.items() if k in wanted})
    # The second shard's entry off by its first hex digit.
    line = sums.splitlines()[1]
    wrong = sums.replace(line, ("0" if line[0] != "0" else "1") + line[1:])
    s3_env.put("vstream/SHA256SUMS", wrong.encode())
    got = []
    with pytest.raises(dmaload.safetensors.CollectiveLoadError, match="SHA-256 mismatch"):
        for name, _ in dmaload.safetensors.iter_tensors("s3://models/vstream/", verify=True):
            got.append(name)
    assert sorted(got) == ["a", "b", "c"], got


def test_an_s3_model_streams_in_windows_and_a_filter_leaves_the_rest_unread(s3_env: Garage, tmp_path: Path) -> None:
    """``window=`` and ``tensor_filter=`` on an ``s3://`` model: the
    stream's windows, each received by ranged GETs in place into its
    buffer (``LoadRequest::object(..).fill_arriving``); the tensors wanted
    are bit-exact, in data order, and ``load_file``/``safe_open`` with a
    filter give the same."""
    pytest.importorskip("torch")
    expected = _put_sharded(s3_env, tmp_path, "windowed")
    got = list(dmaload.safetensors.iter_tensors("s3://models/windowed/", window="64K"))
    names = [name for name, _ in got]
    assert sorted(names[:3]) == ["a", "b", "c"] and sorted(names[3:]) == ["d", "e"], names
    _assert_same(dict(got), expected)
    wanted = {"b", "d"}
    filtered = dict(dmaload.safetensors.iter_tensors("s3://models/windowed/", tensor_filter=wanted, window="1M"))
    _assert_same(filtered, {k: v for k, v in expected.items() if k in wanted})
    _assert_same(dmaload.safetensors.load_file("s3://models/windowed/", framework="pt", tensor_filter=wanted), filtered)


class _CountingProxy:
    """A TCP relay to the server that counts the bytes it sends back: what
    one client received from the store."""

    def __init__(self, port: int) -> None:
        import threading

        self.received = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._upstream = port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._upstream))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                if counted:
                    with self._lock:
                        self.received += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


def test_ranks_of_a_group_each_get_their_share_of_an_s3_model(s3_env: Garage, tmp_path: Path) -> None:
    """``iter_tensors("s3://...", process_group=)`` on 2 gloo ranks: each
    rank receives about half the model from the store (counted by a relay
    in front of the server, one per rank) and every rank gets every tensor
    bit-exact: the group reads each byte of the objects once."""
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    from test_collective import _result, _run

    st_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.rand((1 << 20) + 1000 * i, generator=g) for i in range(4)}
    st_torch.save_file(tensors, tmp_path / "model.safetensors")
    body = (tmp_path / "model.safetensors").read_bytes()
    s3_env.put("group/model.safetensors", body)
    url = "s3://models/group/model.safetensors"
    proxies = [_CountingProxy(s3_env.s3_port) for _ in range(2)]
    try:
        wrap = {r: ["env", f"AWS_ENDPOINT_URL=http://127.0.0.1:{p.port}"] for r, p in enumerate(proxies)}
        results = [_result(*r) for r in _run(tmp_path, 2, "paths", tmp_path, url, url, wrap=wrap)]
    finally:
        for p in proxies:
            p.close()
    expected = {name: int(t.view(torch.uint8).sum()) for name, t in tensors.items()}
    assert [r["sums"] for r in results] == [expected, expected]
    received = [p.received for p in proxies]
    # Half the object each, and the header's GET (64 KiB) and the responses' heads.
    assert all(len(body) // 2 - (64 << 10) < n < len(body) // 2 + (192 << 10) for n in received), (received, len(body))


def _tls_proxy(garage: Garage, directory: Path) -> tuple[subprocess.Popen[str], int]:
    """A real TLS server in front of Garage (crates/dmaload/tests/support/
    tls_proxy.py) with a certificate for 127.0.0.1 signed by ``ca.pem``, an
    authority made with the ``openssl`` CLI; ``stranger.pem`` signed nothing."""
    if shutil.which("openssl") is None:
        print("SKIP test_an_https_endpoint: no openssl CLI to make test certificates")
        pytest.skip("no openssl")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    for ca in ("ca", "stranger"):
        run("req", "-x509", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}")
    run("req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (directory / "ext.cnf").write_text("subjectAltName = IP:127.0.0.1\nextendedKeyUsage = serverAuth\n")
    run(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf",
    )
    script = Path(__file__).resolve().parents[3] / "crates/dmaload/tests/support/tls_proxy.py"
    proxy = subprocess.Popen(
        [sys.executable, str(script), "server.pem", "server.key", str(garage.s3_port)],
        cwd=directory, stdout=subprocess.PIPE, text=True,
    )
    assert proxy.stdout is not None
    return proxy, int(proxy.stdout.readline())


def test_an_https_endpoint_loads_with_aws_ca_bundle_and_refuses_an_untrusted_certificate(
    s3_env: Garage, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    proxy, port = _tls_proxy(s3_env, tmp_path)
    try:
        body = os.urandom((3 << 20) + 5)
        s3_env.put("tls/model.bin", body)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"https://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "ca.pem"))
        assert bytes(dmaload.load("s3://models/tls/model.bin")) == body
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "stranger.pem"))
        with pytest.raises(OSError, match=f"TLS handshake with 127.0.0.1:{port} failed: .*UnknownIssuer") as raised:
            dmaload.load("s3://models/tls/model.bin")
        assert "stranger.pem" in str(raised.value) and s3_env.secret_key not in str(raised.value)
    finally:
        proxy.kill()
        proxy.wait()


def test_ranks_that_see_different_objects_fail_every_rank_before_reading(s3_env: Garage, tmp_path: Path) -> None:
    """Two ranks handed objects of the same name and tables but other bytes
    (another prefix: another checkpoint): the ranks' agreement on URL,
    ETag and size fails on every rank, naming it, before any window is
    read."""
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    from test_collective import _run

    st_torch = pytest.importorskip("safetensors.torch")
    for version in (1, 2):
        g = torch.Generator().manual_seed(version)
        st_torch.save_file({"w": torch.rand(1 << 16, generator=g)}, tmp_path / "model.safetensors")
        s3_env.put(f"v{version}/model.safetensors", (tmp_path / "model.safetensors").read_bytes())
    urls = [f"s3://models/v{version}/model.safetensors" for version in (1, 2)]
    for status, output in _run(tmp_path, 2, "paths", tmp_path, *urls):
        assert status != 0 and "rank 1 was handed another object than rank 0" in output, output


def test_an_object_through_the_cache_service_is_read_once_then_mapped_under_its_etag(
    s3_env: Garage, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from test_cache import Service

    url = "s3://models/cached/model.bin"
    v1, v2 = os.urandom((3 << 20) + 5), os.urandom((3 << 20) + 5)
    s3_env.put("cached/model.bin", v1)
    service = Service(tmp_path / "cache.sock")
    try:
        first = dmaload.load(url, cache=str(service.socket))
        again = dmaload.load(url, cache=str(service.socket))
        assert bytes(first) == v1 and bytes(again) == v1
        assert (first.report.destination, again.report.destination) == (
            "cache-service (miss)",
            "cache-service (hit)",
        )
        # A new version has a new ETag: read again, never the cached bytes.
        s3_env.put("cached/model.bin", v2)
        third = dmaload.load(url, cache=str(service.socket))
        assert bytes(third) == v2 and third.report.destination == "cache-service (miss)"
        status = service.status()
        assert (status["hits"], status["misses"]) == (1, 2), status

        # A sharded model's shards, each kept by the service: the second
        # load maps every shard from it.
        expected = _put_sharded(s3_env, tmp_path, "cached-model")
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a direct load would warn why
                got = dmaload.safetensors.load_file("s3://models/cached-model/", framework="pt", cache=str(service.socket))
            _assert_same(got, expected)
        status = service.status()
        assert (status["hits"], status["misses"]) == (3, 4), status
    finally:
        service.stop()


def test_an_object_loads_into_a_dma_buf_or_names_the_missing_producer(s3_env: Garage) -> None:
    """An ``s3://`` object into a dma-buf as a file goes (the QEMU guest of
    tests/vm/ci.sh loads one for real); on a kernel without the producer,
    the error names its device rather than refusing the object."""
    body = os.urandom((1 << 20) + 3)
    s3_env.put("dmabuf/model.bin", body)
    for to, device in (("udmabuf", "/dev/udmabuf"), ("dma-heap:system", "/dev/dma_heap/system")):
        if os.path.exists(device):
            with dmaload.load_dmabuf("s3://models/dmabuf/model.bin", to=to) as dmabuf:
                assert dmabuf.tobytes() == body
        else:
            with pytest.raises(OSError, match=device):
                dmaload.load_dmabuf("s3://models/dmabuf/model.bin", to=to)


# The child of the object-through-the-service case: argv = socket, then
# URL and local copy pairs. Each shard gets one emulated allocation of its
# whole length (header and data, as `_device.load_files` lays it out) and
# `_load_staged(..., socket=)` has the service copy it there.
SERVICE_OBJECT_CHILD = r"""
import ctypes, os, sys
from dmaload import _dmaload

cuda = ctypes.CDLL(os.environ["DMALOAD_LIBCUDA"])
def check(code):
    assert code == 0, code
check(cuda.cuInit(0))
device, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cuda.cuDeviceGet(ctypes.byref(device), 0))
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
check(cuda.cuCtxPushCurrent_v2(ctx))
socket, urls, copies = sys.argv[1], sys.argv[2::2], sys.argv[3::2]
for url, copy in zip(urls, copies):
    body = open(copy, "rb").read()
    file = _dmaload.open_safetensors(url)
    dptr = ctypes.c_ulonglong()
    check(cuda.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(len(body))))
    [report] = _dmaload._load_staged([file], [dptr.value + file.data_start], 0, socket=socket)
    back = ctypes.create_string_buffer(len(body))
    check(cuda.cuMemcpyDtoH_v2(back, dptr, ctypes.c_size_t(len(body))))
    print("OK" if back.raw == body else "DIFFERENT", url, report.destination, [f.reason for f in report.fallbacks])
"""


def test_s3_shards_reach_device_memory_through_the_cache_service(
    s3_env: Garage, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``load_file("s3://...", device="cuda:N", cache=...)``'s native step
    on the CUDA driver emulator: the service (which holds no keys) reads
    each shard with the client's grant and copies it into the client's
    device memory; the client's driver refuses to pin or copy, so it did
    neither. A second run is served from the service's copies."""
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        print("SKIP test_s3_shards_reach_device_memory_through_the_cache_service: no C compiler for the emulator")
        pytest.skip("no C compiler")
    pytest.importorskip("torch")
    from test_cuda_emulator import CLIENT_PINS_NOTHING, _serve

    emulator = tmp_path_factory.mktemp("cuda-emu-service")
    root = Path(__file__).resolve().parents[3]
    subprocess.run(["bash", str(root / "tests/cuda-emu/build.sh"), str(emulator)], check=True)
    _put_sharded(s3_env, tmp_path, "served")
    args = []
    for i in (1, 2):
        name = f"model-0000{i}-of-00002.safetensors"
        args += [f"s3://models/served/{name}", str(tmp_path / name)]
    socket_path = tmp_path / "cache.sock"
    keyless = {name: "" for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    service = _serve(str(emulator / "libcuda.so.1"), socket_path, keyless)
    try:
        env = dict(
            os.environ,
            DMALOAD_LIBCUDA=str(emulator / "libcuda.so.1"),
            DMALOAD_EMU_STRICT="1",
            DMALOAD_EMU_FAULTS=CLIENT_PINS_NOTHING,
        )
        for served in ("miss", "hit"):
            out = subprocess.run(
                [sys.executable, "-c", SERVICE_OBJECT_CHILD, str(socket_path), *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 0, out.stdout + out.stderr
            lines = out.stdout.splitlines()
            assert len(lines) == 2, out.stdout
            for line in lines:
                assert line.startswith("OK s3://models/served/"), out.stdout
                assert f"via cache-service ({served}) []" in line, out.stdout
    finally:
        service.kill()
        service.wait()
