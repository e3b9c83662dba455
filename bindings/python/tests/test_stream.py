"""``iter_tensors`` without a process group: one load per window (a whole
file here: these shards are smaller than a window), each tensor handed out
as soon as the bytes under it have arrived (the load's arrival reports),
bit-exact with safetensors; a load that fails mid-file raises and hands out
nothing after it, and Ctrl-C reaches a consumer waiting for bytes. The
loads are observed by wrapping the native ``WindowLoader`` (its
``submit(arrived=)`` callback runs on the loader's thread), never by
timing: where a test needs the load to be mid-file, the wrapper holds it
there until the consumer has done what is checked."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from dmaload import _dmaload  # noqa: E402
from dmaload.safetensors import _collective, iter_tensors  # noqa: E402
from checkpoints import copy_model, write_sums  # noqa: E402

GUARD_S = 60  # a wait this long means the load or the consumer hung: fail
WINDOW_LOADER = _dmaload.WindowLoader  # the native one, whatever a test patches in


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two shards of about 27 MiB, small tensors first (safetensors orders
    the data by dtype, then name: the F32 ``a*`` come first, well within the
    first gather a load reports) and larger ones after, several dtypes and
    an empty tensor."""
    out = tmp_path_factory.mktemp("model")
    g = torch.Generator().manual_seed(11)
    for s in range(2):
        tensors = {f"s{s}.a{i}": torch.randn(257 + i, generator=g) for i in range(5)}
        tensors[f"s{s}.empty"] = torch.empty(0, 5)
        tensors[f"s{s}.ints"] = torch.randint(-9, 9, (1000, 333), generator=g, dtype=torch.int32)
        for i in range(4):
            tensors[f"s{s}.w{i}"] = torch.randn(1024 + i, 1536, generator=g).to(torch.bfloat16)
        tensors[f"s{s}.big"] = torch.randn(2048, 2048, generator=g)
        safetensors_torch.save_file(tensors, out / f"model-{s + 1:05d}-of-00002.safetensors")
    return out


def _reference(model: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in sorted(model.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(p))
    return out


def _same_bytes(a: Any, b: Any) -> bool:
    return bool(a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8)))


def _data_order(model: Path) -> list[str]:
    """The tensor names in the order of their bytes in the files."""
    names = []
    for p in sorted(model.glob("*.safetensors")):
        header = _dmaload.read_safetensors_header(str(p))
        names += [t.name for t in sorted(header.tensors, key=lambda t: t.begin)]
    return names


class _Watched:
    """A native ``WindowLoader`` whose loads report each arrival to
    ``relay(loader, (path, offset), length, n)`` on the load's thread (which
    waits while it runs; two loads run at once); ``closed`` is set when the
    stream closes it."""

    def __init__(
        self, relay: Callable[[_Watched, tuple[str, int], int, int], None], files: list[int], **kwargs: Any
    ) -> None:
        self.paths = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in files]
        self.closed = threading.Event()
        self._relay = relay
        self._loader = WINDOW_LOADER(files, **kwargs)

    def submit(self, file: int, offset: int, target: Any) -> Any:
        load, length = (self.paths[file], offset), len(target)
        return self._loader.submit(file, offset, target, arrived=lambda n: self._relay(self, load, length, n))

    def check_memory(self, file: int, n: int) -> None:
        self._loader.check_memory(file, n)

    def close(self) -> None:
        self.closed.set()
        self._loader.close()


def _watch_loads(
    monkeypatch: pytest.MonkeyPatch, relay: Callable[[_Watched, tuple[str, int], int, int], None]
) -> None:
    monkeypatch.setattr(_collective._dmaload, "WindowLoader", lambda *a, **k: _Watched(relay, *a, **k))


def _hold_after_first_arrival(
    monkeypatch: pytest.MonkeyPatch, then: Callable[[_Watched], None]
) -> dict[tuple[str, int], list[int]]:
    """Each load's first arrival report is passed on, then ``then(loader)``
    runs on the load's thread before it may report (or end) any further.
    Returns the reports seen, per load: (file path, offset)."""
    seen: dict[tuple[str, int], list[int]] = {}

    def relay(loader: _Watched, load: tuple[str, int], _length: int, n: int) -> None:
        reports = seen.setdefault(load, [])
        reports.append(n)
        if len(reports) == 1:
            then(loader)

    _watch_loads(monkeypatch, relay)
    return seen


def _loader_threads() -> list[str]:
    """The native loader threads of this process (their names)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(comm.read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return [n for n in names if n == "dmaload-windows"]


def _within_guard(holds: Callable[[], Any]) -> Any:
    """``holds()`` once it is true, polled up to the guard (falsy past it)."""
    deadline = time.monotonic() + GUARD_S
    while not (held := holds()) and time.monotonic() < deadline:
        time.sleep(0.001)
    return held


def _no_loader_thread_is_left() -> bool:
    """Waits (up to the guard) for the native loader threads to end: a
    closed loader's thread ends once the load it cancelled returns."""
    return bool(_within_guard(lambda: not _loader_threads()))


def test_every_tensor_is_bit_exact_with_safetensors(model: Path) -> None:
    reference = _reference(model)
    names = []
    for name, t in iter_tensors(model):
        assert t.dtype == reference[name].dtype and t.shape == reference[name].shape, name
        assert _same_bytes(t, reference[name]), name
        names.append(name)
    assert sorted(names) == sorted(reference)
    empties = [n for n in names if reference[n].numel() == 0]
    assert names[len(empties) :] == [n for n in _data_order(model) if n not in empties]


def test_the_first_tensors_are_handed_out_while_their_file_is_still_loading(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first file's load is held after its first report until the
    consumer has its first tensor: had the consumer waited for the whole
    file, it would never get one (the guard fails the test instead)."""
    consumer_has_one = threading.Event()

    def hold(_loader: _Watched) -> None:
        assert consumer_has_one.wait(GUARD_S), "the consumer got no tensor while the load was held"

    seen = _hold_after_first_arrival(monkeypatch, hold)
    reference = _reference(model)
    first = sorted(model.glob("*.safetensors"))[0]
    got = {}
    for name, t in iter_tensors(model):
        if reference[name].numel() and not consumer_has_one.is_set():
            # The first file's first load has said only that its first bytes
            # are in. The consumer may hear that (natively) before the relay,
            # which waits for the GIL, records it: give the relay its turn.
            loads = _within_guard(lambda: [load for load in list(seen) if load[0] == os.path.realpath(first)])
            assert loads, "the first file's first report never reached the relay"
            held = seen[min(loads)]
            assert len(held) == 1 and held[0] < first.stat().st_size, held
            consumer_has_one.set()
        got[name] = t
    assert consumer_has_one.is_set()
    assert all(_same_bytes(got[n], reference[n]) for n in reference)


def test_a_load_failing_mid_file_raises_and_hands_out_nothing_after_it(
    model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first file is cut short after its load's first report: the
    iteration raises (naming the read, from the OSError of the load), and
    every tensor handed out before is whole and bit-exact."""
    copy = tmp_path / "model"
    copy.mkdir()
    for p in model.glob("*.safetensors"):
        (copy / p.name).write_bytes(p.read_bytes())
    first = sorted(copy.glob("*.safetensors"))[0]

    def cut(_loader: _Watched) -> None:
        os.truncate(first, first.stat().st_size // 2)

    _hold_after_first_arrival(monkeypatch, cut)
    reference = _reference(model)
    got = []
    with pytest.raises(_collective.CollectiveLoadError, match=str(first)) as raised:
        for name, t in iter_tensors(copy):
            assert _same_bytes(t, reference[name]), name
            got.append(name)
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno, raised.value
    order = [n for n in _data_order(model) if reference[n].numel()]
    handed = [n for n in got if reference[n].numel()]
    assert handed == order[: len(handed)] and len(handed) < len(order) // 2, handed


def test_a_load_failing_after_its_last_byte_still_fails_the_iteration(
    model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A load whose every gather arrived and whose file is then written
    (its times moved, as a writer moves them) fails at its end check: the
    iteration raises before the next file's tensors, and also when it is
    the last file's."""
    copy = tmp_path / "model"
    copy.mkdir()
    for p in model.glob("*.safetensors"):
        (copy / p.name).write_bytes(p.read_bytes())
    files = sorted(copy.glob("*.safetensors"))
    reference = _reference(model)
    for failing in files:
        touched = threading.Event()

        def touch_after_the_last_gather(
            _loader: _Watched, load: tuple[str, int], length: int, n: int, _bad: str = os.path.realpath(failing)
        ) -> None:
            # The last gather's report (the edge after it, under a page,
            # comes with the end): the end check is still to come.
            if load[0] == _bad and n >= length - 4096 and not touched.is_set():
                os.utime(load[0])
                touched.set()

        _watch_loads(monkeypatch, touch_after_the_last_gather)
        got = []
        with pytest.raises(_collective.CollectiveLoadError, match="written during the load"):
            for name, t in iter_tensors(copy):
                assert _same_bytes(t, reference[name]), name
                got.append(name)
        assert touched.is_set()
        later = [n for f in files[files.index(failing) + 1 :] for n in _names_in(f) if reference[n].numel()]
        assert not set(got) & set(later), failing


def _names_in(path: Path) -> list[str]:
    return [t.name for t in _dmaload.read_safetensors_header(str(path)).tensors]


def test_ctrl_c_reaches_a_consumer_waiting_for_bytes(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load is held after its first report until the consumer has
    left; SIGINT, sent then, must raise KeyboardInterrupt in the consumer
    waiting for later bytes (its wait holds no GIL and is interruptible),
    and leaving stops the load: no loader thread is left."""

    def interrupt_and_hold(loader: _Watched) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        assert loader.closed.wait(GUARD_S), "the consumer never left"

    _hold_after_first_arrival(monkeypatch, interrupt_and_hold)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    count = 0
    try:
        with pytest.raises(KeyboardInterrupt):
            for _name, _t in iter_tensors(model):
                count += 1
    finally:
        signal.signal(signal.SIGINT, previous)
    assert count < len(_reference(model))
    assert _no_loader_thread_is_left(), _loader_threads()


def _stream(model: Path) -> _collective.Stream:
    return _collective.Stream(sorted(model.glob("*.safetensors")), recycle=True)


def test_a_stream_started_before_its_iteration_reads_then_hands_out_the_same_tensors(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a serving engine does while it builds its model: ``start()``
    reads before anyone asks for a tensor (the first bytes come in with no
    consumer), and the iteration then takes over those bytes."""
    first_bytes_in = threading.Event()
    _hold_after_first_arrival(monkeypatch, lambda _loader: first_bytes_in.set())
    reference = _reference(model)
    stream = _stream(model)
    assert stream.arrived() == 0
    stream.start()
    assert first_bytes_in.wait(GUARD_S), "nothing was read before the iteration began"
    assert stream.arrived() > 0
    got = {name: t.clone() for name, t in stream}
    assert sorted(got) == sorted(reference)
    assert all(_same_bytes(got[n], reference[n]) for n in reference)
    assert _no_loader_thread_is_left(), _loader_threads()


def test_a_stream_started_and_closed_unread_stops_its_load_and_closes_its_files(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose model build fails closes the read it began: the load
    under way is cancelled (held here until the stream says stop), the
    thread is waited for and the files are closed."""
    held = threading.Event()

    def hold_until_stopped(loader: _Watched) -> None:
        held.set()
        assert loader.closed.wait(GUARD_S), "close() never stopped the load"

    _hold_after_first_arrival(monkeypatch, hold_until_stopped)
    stream = _stream(model)
    fds = list(stream._fds)
    stream.start()
    assert held.wait(GUARD_S)
    stream.close()
    assert _no_loader_thread_is_left(), _loader_threads()
    for fd in fds:
        with pytest.raises(OSError) as closed:
            os.fstat(fd)
        assert closed.value.errno == errno.EBADF


def test_a_file_is_loaded_a_window_at_a_time_into_a_ring_of_buffers(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a group, whether its bytes come from the disk or the page
    cache, a file is one load per ``DEFAULT_WINDOW`` of its tensors (split
    between tensors only, a larger tensor alone), read into a ring of
    ``RING`` buffers, so the host memory the stream faults in is bounded
    by the window, not by the shard; the tensors are the same."""
    monkeypatch.setattr(_collective, "DEFAULT_WINDOW", 8 << 20)
    reference = _reference(model)
    paths = sorted(model.glob("*.safetensors"))
    with _collective.Stream(paths, recycle=True, options={"mode": "direct"}) as stream:
        assert len(stream.windows) > 2 * len(paths), stream.windows
        for w in stream.windows:
            assert w.end - w.start <= (8 << 20) + 4096 or len(w.tensors) == 1, w
        got = {name: t.clone() for name, t in stream}
        assert stream._buffers._made == _collective.RING
    assert sorted(got) == sorted(reference)
    assert all(_same_bytes(got[name], reference[name]) for name in reference)


# The native WindowLoader the stream queues its windows on.


def test_a_window_loader_runs_its_loads_in_order_into_the_callers_buffers(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    path = tmp_path / "data"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        loader = _dmaload.WindowLoader([fd, str(path)])
        ranges = [(0, 0, 1 << 20), (1, 4096, 5000), (0, (1 << 20) + 123, (2 << 20) - 123)]
        targets = [bytearray(n) for _, _, n in ranges]
        arrivals = [loader.submit(f, at, t) for (f, at, _), t in zip(ranges, targets)]
        for (_, at, n), target, arrival in zip(ranges, targets, arrivals):
            arrival.wait(n // 2)
            arrival.wait_done()
            assert arrival.count() == n and target == data[at : at + n]
        with pytest.raises(ValueError, match="fewer than asked"):
            arrivals[0].wait(ranges[0][2] + 1)  # more than its target: answered, not waited for
        loader.close()
        loader.close()
        with pytest.raises(ValueError, match="closed"):
            loader.submit(0, 0, bytearray(1))
        with pytest.raises(IndexError):
            _dmaload.WindowLoader([fd]).submit(1, 0, bytearray(1))
    finally:
        os.close(fd)


def test_a_failed_load_ends_the_window_loader_and_fails_the_loads_after_it(tmp_path: Path) -> None:
    """A range past the end fails its load (OSError naming it); the loads
    queued after it, and any submitted later, are not run and say why."""
    path = tmp_path / "data"
    path.write_bytes(os.urandom(1 << 20))
    loader = _dmaload.WindowLoader([str(path)])
    good = loader.submit(0, 0, bytearray(4096))
    bad = loader.submit(0, 1 << 20, bytearray(4096))
    queued = [loader.submit(0, 0, bytearray(4096)) for _ in range(4)]
    good.wait_done()
    with pytest.raises(OSError) as failed:
        bad.wait(1)
    assert str(path) in str(failed.value), failed.value
    for arrival in [*queued, loader.submit(0, 0, bytearray(1))]:
        with pytest.raises(OSError, match="an earlier load of this loader failed") as skipped:
            arrival.wait_done()
        assert skipped.value.errno == errno.ECANCELED
    loader.close()


def test_closing_a_window_loader_fails_its_queued_loads_and_ends_its_thread(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(os.urandom(8 << 20))
    loader = _dmaload.WindowLoader([str(path)])
    arrivals = [loader.submit(0, 0, bytearray(8 << 20)) for _ in range(16)]
    loader.close()
    outcomes = []
    for arrival in arrivals:
        try:
            arrival.wait_done()
            outcomes.append("loaded")
        except OSError as exc:
            outcomes.append("not run" if "closed" in str(exc) else f"cancelled: {exc}")
    assert outcomes[-1] == "not run", outcomes
    assert _no_loader_thread_is_left(), _loader_threads()


def test_an_empty_tensor_does_not_split_a_window(model: Path) -> None:
    """A zero-byte tensor between two others takes no bytes: the run of a
    window goes on across it (each shard here has one, and fits a window)."""
    paths = sorted(model.glob("*.safetensors"))
    with _collective.Stream(paths) as stream:
        assert [w.file for w in stream.windows] == list(range(len(paths))), stream.windows


def _flip_last_tensor(directory: Path) -> tuple[Path, str]:
    """Flips a byte of the last tensor (in data order) of the first shard;
    returns the shard and that tensor's name."""
    path = sorted(directory.glob("*.safetensors"))[0]
    header = _dmaload.read_safetensors_header(str(path))
    last = max(header.tensors, key=lambda t: t.begin)
    with open(path, "r+b") as f:
        f.seek(header.data_start + last.begin)
        byte = f.read(1)
        f.seek(header.data_start + last.begin)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path, last.name


def test_verify_checks_every_streamed_path_against_the_sums_file(model: Path, tmp_path: Path) -> None:
    """``verify=True`` on the paths that stream a file in windows: the
    iteration, a filtered ``load_file`` (the bytes it leaves out are read and
    hashed too), in small windows and in one; an intact file loads, a byte
    changed where no tensor asked for lies fails the load naming the sums
    file."""
    from dmaload.safetensors import CollectiveLoadError, load_file

    intact = copy_model(model, tmp_path / "intact")
    write_sums(intact)
    reference = _reference(model)
    for window in ("64K", None):
        got = {name: t.clone() for name, t in iter_tensors(intact, window=window, verify=True)}
        assert sorted(got) == sorted(reference)
        assert all(_same_bytes(got[n], reference[n]) for n in reference)
    keep = {"s0.a0", "s1.ints"}
    filtered = load_file(intact, framework="pt", tensor_filter=keep, verify=True)
    assert filtered.keys() == keep and all(_same_bytes(filtered[n], reference[n]) for n in keep)

    changed = copy_model(intact, tmp_path / "changed")
    _, flipped = _flip_last_tensor(changed)
    assert flipped not in keep
    with pytest.raises(CollectiveLoadError, match=r"SHA-256 mismatch: .*SHA256SUMS \(line 1\) expects"):
        load_file(changed, framework="pt", tensor_filter=keep, verify=True)
    with pytest.raises(CollectiveLoadError, match="SHA-256 mismatch"):
        for _ in iter_tensors(changed, window="64K", verify=True):
            pass
    (changed / "SHA256SUMS").unlink()
    with pytest.raises(OSError, match="dmaload sums") as missing:
        iter_tensors(changed, verify=True).__next__()
    assert missing.value.errno == errno.EINVAL


def test_a_rewrite_after_the_stream_opened_its_files_fails_it(model: Path, tmp_path: Path) -> None:
    """One logical load, however many loads it is made of: the files are
    opened once when the stream is, and a same-size rewrite after that
    (here before the early read, which opens nothing of its own) fails the
    iteration rather than handing out the new bytes under the old header."""
    from dmaload.safetensors import CollectiveLoadError

    copy = copy_model(model, tmp_path / "copy")
    path, _ = _flip_last_tensor(copy)
    stream = _collective.Stream([path], window="1M")
    _flip_last_tensor(copy)  # the bytes back as they were, the file written
    with pytest.raises(CollectiveLoadError, match="written during the load"):
        stream.start()
        for _ in stream:
            pass


def _memory_cgroup(tmp_path: Path, limit: int) -> Path | None:
    """A child of this process's memory cgroup (v2, else v1) limited to
    ``limit`` bytes: its ``cgroup.procs``; None where that is not possible
    here (no cgroup mounted, or not allowed to create one)."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for mount in mounts:
            left, right = mount.split(" - ", 1)
            fstype, _, options = right.split(" ", 2)
            if (v2 and fstype == "cgroup2") or (not v2 and fstype == "cgroup" and "memory" in options.split(",")):
                child = Path(left.split(" ")[4]) / where.lstrip("/") / f"dmaload-stream-{os.getpid()}-{tmp_path.name}"
                try:
                    child.mkdir()
                    (child / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
                except OSError:
                    continue
                return child / "cgroup.procs"
    return None


STREAM_IN_A_CGROUP = """
import os, sys
import torch
from dmaload.safetensors import iter_tensors, load_file
procs, model = sys.argv[1:]
# Moved in after the imports: the limit counts what the loads allocate.
with open(procs, "w") as f:
    f.write(str(os.getpid()))
try:
    load_file(model, framework="pt")
    print("load_file: loaded")
except OSError as exc:
    print(f"load_file: errno {exc.errno}")
count = 0
for name, t in iter_tensors(model, window="48M"):
    count += 1
print(f"iter_tensors: {count} tensors")
"""


def test_a_stream_reads_ahead_only_what_the_memory_check_admits(tmp_path: Path) -> None:
    """In a memory cgroup where ``load_file`` fails cleanly (ENOMEM, its
    memory check), a stream asks the same check before each window buffer:
    it reads ahead less, not into the OOM killer (five 48 MiB windows ahead
    would exceed the limit)."""
    import subprocess
    import sys

    model = tmp_path / "model.safetensors"
    g = torch.Generator().manual_seed(3)
    safetensors_torch.save_file({f"t{i:02d}": torch.randn(4 << 20, generator=g) for i in range(20)}, model)
    procs = _memory_cgroup(tmp_path, 192 << 20)
    if procs is None:
        pytest.skip("SKIP test_a_stream_reads_ahead_only_what_the_memory_check_admits: cannot create a memory cgroup here")
    try:
        run = subprocess.run(
            [sys.executable, "-c", STREAM_IN_A_CGROUP, str(procs), str(model)],
            capture_output=True,
            text=True,
            timeout=GUARD_S * 4,
        )
    finally:
        procs.parent.rmdir()
    assert f"load_file: errno {errno.ENOMEM}" in run.stdout, (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.returncode == 0 and "iter_tensors: 20 tensors" in run.stdout, (run.returncode, run.stdout, run.stderr[-2000:])
