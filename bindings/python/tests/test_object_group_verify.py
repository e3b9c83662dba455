"""Verified loads of an ``s3://`` model shared by the ranks of a gloo group
(``process_group=`` and ``verify=True`` on ``iter_tensors`` and
``load_file``): each rank a real process (collective_worker.py), the
objects on a real Garage server (test_object_store.py's fixture), each
rank's traffic counted by a relay in front of the server. The object
counterparts of test_collective.py's verified file loads: every rank gets
every tensor bit-exact while the group reads each byte once and hashes
every object against the ``SHA256SUMS`` object beside it; an object whose
bytes differ from its sums entry fails every rank, naming it; ranks handed
two checkpoints fail every rank before reading."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("SKIP test_object_group_verify: this torch has no gloo backend", allow_module_level=True)

from test_collective import _all_fail, _result, _run  # noqa: E402
from test_object_store import Garage, _CountingProxy, _tensors, garage, s3_env  # noqa: E402,F401

SHARDS = {"model-00001-of-00002.safetensors": ["a", "b", "c", "d"], "model-00002-of-00002.safetensors": ["e", "f"]}
VERIFY = json.dumps({"verify": True})
SLACK = 256 << 10
"""What a rank receives beyond its share of the windows: the index, each
shard's header GET (64 KiB), the sums object and the responses' heads."""


def _put_model(server: Garage, tmp_path: Path, prefix: str, seed: int) -> tuple[dict[str, str], dict[str, bytes]]:
    """Two shards (about 8 MiB), their index and SHA256SUMS under
    ``prefix``: each tensor's SHA-256 as safetensors reads it back from the
    files, and each shard's bytes."""
    weight_map: dict[str, str] = {}
    expected: dict[str, str] = {}
    bodies: dict[str, bytes] = {}
    for i, (name, names) in enumerate(SHARDS.items()):
        local = tmp_path / f"{prefix}-{name}"
        st_torch.save_file(_tensors(seed + i, names), local)
        bodies[name] = local.read_bytes()
        server.put(f"{prefix}/{name}", bodies[name])
        for tensor, t in st_torch.load_file(local).items():
            expected[tensor] = hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        weight_map |= dict.fromkeys(names, name)
    server.put(f"{prefix}/model.safetensors.index.json", json.dumps({"weight_map": weight_map}).encode())
    sums = "".join(f"{hashlib.sha256(body).hexdigest()}  {name}\n" for name, body in bodies.items())
    server.put(f"{prefix}/SHA256SUMS", sums.encode())
    return expected, bodies


def _run_counted(server: Garage, tmp_path: Path, scenario: str, *args: str) -> tuple[list[tuple[int, str]], list[int]]:
    """2 ranks of ``scenario``, each reaching the server through its own
    counting relay: each rank's (status, output), and the bytes each
    received from the store."""
    proxies = [_CountingProxy(server.s3_port) for _ in range(2)]
    try:
        wrap = {r: ["env", f"AWS_ENDPOINT_URL=http://127.0.0.1:{p.port}"] for r, p in enumerate(proxies)}
        results = _run(tmp_path, 2, scenario, tmp_path, *args, wrap=wrap)
    finally:
        for p in proxies:
            p.close()
    return results, [p.received for p in proxies]


@pytest.mark.parametrize("scenario", ["paths", "load_file"])
def test_a_verified_group_load_of_an_s3_model_is_bit_exact_and_reads_each_byte_once(
    s3_env: Garage, tmp_path: Path, scenario: str
) -> None:
    """``iter_tensors`` (paths) and ``load_file`` with ``verify=True`` on 2
    ranks: every rank gets every tensor bit-exact, and each receives about
    half the objects' bytes from the store: the verified windows (every
    byte of each object, header included) are read once across the group
    and hashed by every rank from the exchanged buffers."""
    expected, bodies = _put_model(s3_env, tmp_path, "gverified", seed=20)
    url = "s3://models/gverified/"
    results, received = _run_counted(s3_env, tmp_path, scenario, url, url, VERIFY)
    assert [_result(*r)["sha256"] for r in results] == [expected, expected]
    half = sum(len(b) for b in bodies.values()) // 2
    assert all(half - (64 << 10) < n < half + SLACK for n in received), (received, half)


def test_a_verified_filtered_group_load_of_an_s3_model_still_reads_every_byte_once(
    s3_env: Garage, tmp_path: Path
) -> None:
    """``tensor_filter=`` with ``verify=True``: only the tensors wanted are
    handed out, but every byte of each object is read, once across the
    group (about half the objects per rank), to be hashed."""
    expected, bodies = _put_model(s3_env, tmp_path, "gfiltered", seed=25)
    url = "s3://models/gfiltered/"
    options = json.dumps({"verify": True, "tensor_filter": ["b", "e"]})
    results, received = _run_counted(s3_env, tmp_path, "load_file", url, url, options)
    wanted = {name: expected[name] for name in ("b", "e")}
    assert [_result(*r)["sha256"] for r in results] == [wanted, wanted]
    half = sum(len(b) for b in bodies.values()) // 2
    assert all(half - (64 << 10) < n < half + SLACK for n in received), (received, half)


def test_an_s3_object_its_sums_object_does_not_list_fails_every_rank_saying_how(s3_env: Garage, tmp_path: Path) -> None:
    """A ``SHA256SUMS`` beside the shards that lists only the first: every
    rank refuses before reading, naming the unlisted object and how to
    make the load verifiable."""
    _, bodies = _put_model(s3_env, tmp_path, "gunlisted", seed=35)
    first = "model-00001-of-00002.safetensors"
    s3_env.put("gunlisted/SHA256SUMS", f"{hashlib.sha256(bodies[first]).hexdigest()}  {first}\n".encode())
    url = "s3://models/gunlisted/"
    results, received = _run_counted(s3_env, tmp_path, "paths", url, url, VERIFY)
    _all_fail(
        results,
        "has none for s3://models/gunlisted/model-00002-of-00002.safetensors",
        "upload a B3SUMS or SHA256SUMS listing it beside",
    )
    assert all(n < SLACK for n in received), received


@pytest.mark.parametrize("scenario", ["paths", "load_file"])
def test_an_s3_object_that_differs_from_its_sums_entry_fails_every_rank_naming_it(
    s3_env: Garage, tmp_path: Path, scenario: str
) -> None:
    """The second shard replaced by bytes its ``SHA256SUMS`` entry does not
    record (a byte of its data flipped per MiB; its header, size and
    tables unchanged), the sums object left as it was: every rank reads its
    share, every rank hashes the whole object from the exchange, and every
    rank fails with a ``CollectiveLoadError`` naming the object and the
    mismatch; no rank gets its tensors (``load_file`` returns nothing).
    The same where only rank 0 passes ``verify=True``."""
    _, bodies = _put_model(s3_env, tmp_path, "gbad", seed=30)
    name = "model-00002-of-00002.safetensors"
    data = bytearray(bodies[name])
    start = 8 + int.from_bytes(data[:8], "little")
    for at in range(start + 4096, len(data), 1 << 20):
        data[at] ^= 0xFF
    s3_env.put(f"gbad/{name}", bytes(data))
    # verify=True on rank 0 alone: every rank verifies.
    for options in (VERIFY, json.dumps([{"verify": True}, {}])):
        results = _run(tmp_path, 2, scenario, tmp_path, "s3://models/gbad/", "s3://models/gbad/", options)
        _all_fail(results, "do not match the sums files", "SHA-256 mismatch", f"s3://models/gbad/{name}")
        assert not any("RESULT " in output for _, output in results), results


def test_ranks_handed_two_s3_checkpoints_fail_every_rank_before_reading(s3_env: Garage, tmp_path: Path) -> None:
    """Rank 0 handed one checkpoint's prefix, rank 1 another's (the same
    shard names and tables, other bytes, each beside its own correct
    ``SHA256SUMS``), ``verify=True``: every rank fails naming the object
    the ranks were given differently, before any window is read (each
    rank received little more than the headers and sums)."""
    _put_model(s3_env, tmp_path, "gckpt1", seed=40)
    _put_model(s3_env, tmp_path, "gckpt2", seed=50)
    results, received = _run_counted(s3_env, tmp_path, "load_file", "s3://models/gckpt1/", "s3://models/gckpt2/", VERIFY)
    first = "model-00001-of-00002.safetensors"
    _all_fail(results, "was handed another object than rank 0", "different checkpoints")
    assert f"s3://models/gckpt1/{first}" in results[0][1] and f"s3://models/gckpt2/{first}" in results[1][1], results
    assert all(n < SLACK for n in received), received


def test_ranks_reading_two_mirrors_of_one_url_fail_every_rank_unless_they_hold_the_same_bytes(
    s3_env: Garage, tmp_path: Path
) -> None:
    """The same ``s3://`` URL on two servers (rank 1 through a second
    Garage: another region's mirror), ``verify=True``: where the mirror
    holds another checkpoint under the same keys (beside its own correct
    sums), every rank fails naming the object and its other version;
    once the mirror holds the same bytes, the group loads them verified."""
    (tmp_path / "mirror").mkdir()
    mirror = Garage(s3_env.binary, tmp_path / "mirror")
    try:
        expected, bodies = _put_model(s3_env, tmp_path, "gmirror", seed=60)
        _put_model(mirror, tmp_path, "gmirror", seed=70)
        env = mirror.env()
        wrap = {1: ["env", *(f"{k}={v}" for k, v in env.items())]}
        url = "s3://models/gmirror/"
        results = _run(tmp_path, 2, "load_file", tmp_path, url, url, VERIFY, wrap=wrap)
        _all_fail(results, "another version", f"{url}model-00001-of-00002.safetensors")
        for name, body in bodies.items():
            mirror.put(f"gmirror/{name}", body)
        mirror.put("gmirror/SHA256SUMS", "".join(f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in bodies.items()).encode())
        results = _run(tmp_path, 2, "load_file", tmp_path, url, url, VERIFY, wrap=wrap)
        assert [_result(*r)["sha256"] for r in results] == [expected, expected]
    finally:
        mirror.stop()

