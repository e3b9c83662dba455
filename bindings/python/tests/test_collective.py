"""Collective loads (``process_group=``) over gloo with 2 and 4 ranks, each
rank a real process (collective_worker.py), and tensor filters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("SKIP collective: this torch has no gloo backend", allow_module_level=True)

from dmaload.safetensors import iter_tensors, load_file  # noqa: E402
from checkpoints import copy_model, write_sums  # noqa: E402

WORKER = Path(__file__).with_name("collective_worker.py")
CHUNK = 4 << 20  # the core's default chunk size: the slack each rank is allowed
GUARD_S = 240  # a rank still running after this has hung: the test fails


def _skip(reason: str) -> None:
    if os.environ.get("DMALOAD_TEST_NO_SKIP") == "1":
        pytest.fail(reason)
    pytest.skip(f"SKIP {reason}")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three shards and an index, about 64 MiB: odd sizes, several dtypes,
    an empty tensor and one 16 MiB tensor (the one a filter leaves out)."""
    out = tmp_path_factory.mktemp("model")
    g = torch.Generator().manual_seed(7)
    weight_map = {}
    for s in range(3):
        tensors = {
            f"s{s}.big": torch.randn(1024 + 3 * s, 1365 + s, generator=g).to(torch.bfloat16),
            f"s{s}.mid": torch.randn(777, 2049, generator=g),
            f"s{s}.ints": torch.randint(-128, 127, (33, 4099), generator=g, dtype=torch.int8),
            f"s{s}.empty": torch.empty(0, 3),
        }
        for i in range(9):
            tensors[f"s{s}.small{i}"] = torch.randn(101 * (i + 1), generator=g).to(torch.float16)
        if s == 1:
            tensors["s1.huge"] = torch.randn(4096, 1024, generator=g)  # 16 MiB
        name = f"model-{s + 1:05d}-of-00003.safetensors"
        safetensors_torch.save_file(tensors, out / name)
        weight_map.update({t: name for t in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def _reference(model: Path) -> dict[str, "torch.Tensor"]:
    out = {}
    for p in sorted(model.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(p))
    return out


def _run(
    tmp_path: Path,
    world: int,
    scenario: str,
    model: Path,
    *args: str,
    hung: tuple[int, ...] = (),
    wrap: dict[int, list[str]] | None = None,
) -> list[tuple[int, str]]:
    """Starts ``world`` ranks (rank r's command after ``wrap[r]``, where
    given) and waits for all (the ``hung`` ones, killed once the others
    ended); each rank's (status, output)."""
    rendezvous = tmp_path / f"rendezvous-{scenario}-{world}-{os.urandom(4).hex()}"  # one per run
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                *(wrap or {}).get(r, []),
                *[sys.executable, str(WORKER), str(rendezvous), str(r), str(world), scenario, str(model), *args],
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    results: dict[int, tuple[int, str]] = {}
    try:
        for r in [r for r in range(world) if r not in hung] + list(hung):
            p = procs[r]
            if r in hung:
                p.kill()
            out, _ = p.communicate(timeout=GUARD_S)
            results[r] = (p.returncode, out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [results[r] for r in range(world)]


def _result(status: int, output: str) -> dict:  # type: ignore[type-arg]
    assert status == 0, output
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_every_tensor_bit_exact(tmp_path: Path, model: Path, world: int) -> None:
    results = [_result(*r) for r in _run(tmp_path, world, "equal", model)]
    assert [r["tensors"] for r in results] == [len(_reference(model))] * world


def _file_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_its_share_from_storage(tmp_path: Path, model: Path, world: int) -> None:
    results = [_result(*r) for r in _run(tmp_path, world, "io", model)]
    reads = [r["read"] for r in results]
    if sum(reads) == 0:
        _skip("collective io: /proc/self/io counts no reads on this file system")
    total = _file_bytes(model)
    reference = _reference(model)
    expected_sum = sum(int(t.contiguous().view(-1).view(torch.uint8).sum()) for t in reference.values())
    for r in results:
        assert r["names"] == sorted(reference)
        assert r["sum"] == expected_sum
        # major_faults: code paged in during every measured attempt, whose
        # read-around the counter holds too.
        assert r["read"] <= total // world + CHUNK, (r["rank"], reads, total, r["major_faults"])
    assert sum(reads) <= total * 1.05, (reads, total)


def test_a_filter_leaves_unread_what_no_rank_wants(tmp_path: Path, model: Path) -> None:
    reference = _reference(model)
    names = sorted(n for n in reference if n != "s1.huge")
    wants = {"0": names[::2], "1": names[1::2]}  # disjoint, neither wants s1.huge
    results = [_result(*r) for r in _run(tmp_path, 2, "filter", model, json.dumps(wants))]
    if sum(r["read"] for r in results) == 0:
        _skip("collective io: /proc/self/io counts no reads on this file system")
    for r in results:
        mine = wants[str(r["rank"])]
        assert r["names"] == sorted(mine)
        assert r["sum"] == sum(int(reference[n].contiguous().view(-1).view(torch.uint8).sum()) for n in mine)
    huge = reference["s1.huge"].numel() * 4
    assert sum(r["read"] for r in results) <= _file_bytes(model) - huge + CHUNK
    for r in results:
        # A rank holds what it returned (and the alignment of a window
        # holding only its own tensors), not the windows the other rank's
        # tensors share with its own (each a whole shard here).
        wanted = sum(reference[n].numel() * reference[n].element_size() for n in wants[str(r["rank"])])
        assert r["held"] <= wanted + (64 << 10), (r["rank"], r["held"], wanted)


def test_a_read_failing_on_one_rank_fails_every_rank_naming_it(tmp_path: Path, model: Path) -> None:
    results = _run(tmp_path, 2, "fail", model)
    for rank, (status, output) in enumerate(results):
        assert status != 0, output
        assert "CollectiveLoadError" in output, output
        assert f"rank {rank}: rank 1 failed to read" in output, output
        assert "model-00001-of-00003.safetensors bytes " in output, output


def test_a_rank_that_cannot_read_the_headers_fails_every_rank_naming_it(tmp_path: Path, model: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in model.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    with open(broken / "model-00002-of-00003.safetensors", "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))  # a header longer than the file
    results = _run(tmp_path, 3, "header", model, str(broken))
    for rank, (status, output) in enumerate(results):
        assert status != 0, output
        assert f"rank {rank}: rank 1 could not open or read the headers of 3 file(s)" in output, output
    assert "model-00002-of-00003.safetensors" in results[1][1]


@pytest.mark.parametrize("scenario", ["kill", "quit"])
def test_a_rank_that_dies_mid_load_ends_every_rank_with_an_error(tmp_path: Path, model: Path, scenario: str) -> None:
    results = _run(tmp_path, 3, scenario, model)
    assert results[1][0] != 0
    for rank in (0, 2):
        status, output = results[rank]
        assert status != 0, output
        assert "CollectiveLoadError" in output and f"rank {rank}: a peer rank failed or left" in output, output


def test_a_filter_without_a_group_reads_only_what_it_keeps(tmp_path: Path, model: Path) -> None:
    reference = _reference(model)
    keep = {"s0.mid", "s2.small3", "s1.empty"}
    got = load_file(model, framework="pt", tensor_filter=keep)
    assert got.keys() == keep
    for name in keep:
        assert got[name].equal(reference[name])
    by_predicate = dict(iter_tensors(model, tensor_filter=lambda n: n.startswith("s2."), window="64K"))
    assert by_predicate.keys() == {n for n in reference if n.startswith("s2.")}
    assert all(by_predicate[n].equal(reference[n]) for n in by_predicate)


def test_iter_tensors_hands_out_tensors_in_file_order(model: Path) -> None:
    names = [name for name, _ in iter_tensors(model, window="1M")]
    assert sorted(names) == sorted(_reference(model))
    assert names.index("s0.mid") < names.index("s1.mid") < names.index("s2.mid")


def test_collective_options_are_checked(model: Path) -> None:
    with pytest.raises(ValueError, match="framework='pt'"):
        load_file(model, framework="np", tensor_filter=["s0.mid"])
    with pytest.raises(ValueError, match="window"):
        load_file(model, framework="pt", tensor_filter=["s0.mid"], window=0)
    with pytest.raises(TypeError, match="one str"):
        load_file(model, framework="pt", tensor_filter="s0.mid")


def _same_bytes(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    return bool(a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8)))


def test_recycled_windows_reuse_their_memory_and_hold_each_tensor_a_window_longer(model: Path) -> None:
    from dmaload.safetensors._collective import Stream

    reference = _reference(model)
    with Stream(sorted(model.glob("*.safetensors")), window="1M") as plan:
        windows = len(plan.windows)
    storages, previous, count = set(), None, 0
    for name, t in iter_tensors(model, window="1M", recycle=True):
        assert _same_bytes(t, reference[name]), name
        if previous is not None:  # the last tensor of the window before is still intact
            assert _same_bytes(previous[1], reference[previous[0]]), previous[0]
        if t.numel():
            storages.add(t.untyped_storage().data_ptr())
        previous, count = (name, t), count + 1
    assert count == len(reference)
    assert len(storages) < windows, (len(storages), windows)  # buffers were reused


def _flip_a_byte_per_mib(directory: Path) -> None:
    for p in directory.glob("*.safetensors"):
        data = bytearray(p.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")  # the data section: the header stays valid
        for at in range(start + 4096, len(data), 1 << 20):
            data[at] ^= 0xFF
        p.write_bytes(bytes(data))


def _all_fail(results: list[tuple[int, str]], *needles: str) -> None:
    for rank, (status, output) in enumerate(results):
        assert status != 0, output
        assert f"CollectiveLoadError: rank {rank}: " in output, output
        for needle in needles:
            assert needle in output, (needle, output)


def test_ranks_reading_other_files_without_sums_are_refused_saying_how(tmp_path: Path, model: Path) -> None:
    """Two ranks on one host, each with its own copy (another inode: a
    node-local copy), the second with a byte flipped per MiB: with nothing
    to show the copies hold the same bytes, every rank refuses before
    reading, naming the fix."""
    a = copy_model(model, tmp_path / "a")
    b = copy_model(model, tmp_path / "b")
    _flip_a_byte_per_mib(b)
    _all_fail(_run(tmp_path, 2, "paths", model, str(a), str(b)), "do not all open the same files", "dmaload sums")


def test_ranks_whose_sums_files_disagree_are_refused_before_reading(tmp_path: Path, model: Path) -> None:
    a = copy_model(model, tmp_path / "a")
    b = copy_model(model, tmp_path / "b")
    _flip_a_byte_per_mib(b)
    write_sums(a)
    write_sums(b)  # b's own, correct for b: another checkpoint
    _all_fail(_run(tmp_path, 2, "paths", model, str(a), str(b)), "rank 1's sums file records another digest")


def test_a_copy_that_differs_from_its_sums_file_fails_every_rank(tmp_path: Path, model: Path) -> None:
    """The stale node-local copy beside the same sums file as everyone's:
    the digests agree, the bytes do not; every rank hashes the whole
    stream it is handed (each rank's share of every window) and every rank
    fails before its iteration ends."""
    a = copy_model(model, tmp_path / "a")
    write_sums(a)
    b = copy_model(a, tmp_path / "b")
    _flip_a_byte_per_mib(b)
    _all_fail(_run(tmp_path, 2, "paths", model, str(a), str(b)), "do not match the sums files", "mismatch")


def test_node_local_copies_with_the_same_sums_load_verified(tmp_path: Path, model: Path) -> None:
    a = copy_model(model, tmp_path / "a")
    write_sums(a)
    b = copy_model(a, tmp_path / "b")
    results = [_result(*r) for r in _run(tmp_path, 2, "paths", model, str(a), str(b))]
    expected = {n: int(t.contiguous().view(-1).view(torch.uint8).sum()) for n, t in _reference(model).items()}
    assert [r["sums"] for r in results] == [expected, expected]


def test_a_verified_group_load_of_one_shared_copy_succeeds(tmp_path: Path, model: Path) -> None:
    a = copy_model(model, tmp_path / "a")
    write_sums(a)
    verify = json.dumps({"verify": True})
    results = [_result(*r) for r in _run(tmp_path, 2, "paths", model, str(a), str(a), verify)]
    expected = {n: int(t.contiguous().view(-1).view(torch.uint8).sum()) for n, t in _reference(model).items()}
    assert [r["sums"] for r in results] == [expected, expected]


def test_a_rewrite_between_windows_fails_every_rank(tmp_path: Path, model: Path) -> None:
    """The group's windows are loads of the files each rank opened once:
    a same-size rewrite after the first window fails the load on every
    rank, as it fails a one-file load."""
    copy = copy_model(model, tmp_path / "copy")
    results = _run(tmp_path, 2, "rewrite", copy)
    _all_fail(results, "failed to read")
    assert "written during the load" in results[0][1] + results[1][1]


def test_ranks_passing_different_windows_fail_every_rank_naming_it(tmp_path: Path, model: Path) -> None:
    _all_fail(_run(tmp_path, 2, "window", model), "rank 1 passed window=2097152, rank 0 window=1048576")


def test_a_rank_that_stops_answering_ends_the_others_within_the_heartbeat_bound(tmp_path: Path, model: Path) -> None:
    """A rank stopped mid-load (SIGSTOP: no answer, no closed connection)
    under a group timeout (600 s) longer than this test waits: the others
    end with an error once its heartbeat is silent for DEAD_AFTER seconds,
    not at the group's timeout."""
    results = _run(tmp_path, 3, "stop", model, hung=(1,))
    for rank in (0, 2):
        status, output = results[rank]
        assert status != 0, output
        assert f"rank {rank}: a peer rank failed or left" in output, output
    # The first to notice names the silent rank; the other may hear of it
    # first from that one leaving.
    assert any("rank 1 sent no heartbeat" in results[r][1] for r in (0, 2)), results


def _another_host(tmp_path: Path) -> list[str]:
    """A command prefix that runs a rank as if on another host of a shared
    file system: in a mount namespace of its own where
    ``/proc/sys/kernel/random/boot_id`` reads another boot id (the files
    are the same inodes). Skips where that cannot be arranged (not root)."""
    fake = tmp_path / "another-boot-id"
    fake.write_text("11111111-2222-3333-4444-555555555555\n")
    prefix = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /proc/sys/kernel/random/boot_id && exec "$@"', str(fake)]
    probe = subprocess.run([*prefix, "cat", "/proc/sys/kernel/random/boot_id"], capture_output=True, text=True)
    if probe.returncode != 0 or "1111" not in probe.stdout:
        _skip(f"collective hosts: cannot give a rank another boot id here ({probe.stderr.strip()})")
    return prefix


def test_ranks_on_two_hosts_sharing_a_file_system_need_sums(tmp_path: Path, model: Path) -> None:
    """The same path, the same inodes, but another kernel (boot id) on
    rank 1: one host cannot vouch for what another reads of a shared
    file system, so the load needs the sums file, and loads with it."""
    shared = copy_model(model, tmp_path / "shared")
    wrap = {1: _another_host(tmp_path)}
    _all_fail(_run(tmp_path, 2, "paths", model, str(shared), str(shared), wrap=wrap), "dmaload sums")
    write_sums(shared)
    results = [_result(*r) for r in _run(tmp_path, 2, "paths", model, str(shared), str(shared), wrap=wrap)]
    expected = {n: int(t.contiguous().view(-1).view(torch.uint8).sum()) for n, t in _reference(model).items()}
    assert [r["sums"] for r in results] == [expected, expected]
