"""``iter_tensors`` without a process group: one load per window (a whole
file here: these shards are smaller than a window), each tensor handed out as soon as the bytes under it have arrived (the load's
``arrived`` reports), bit-exact with safetensors; a load that fails mid-file
raises and hands out nothing after it, and Ctrl-C reaches a consumer
waiting for bytes. The loads are observed by wrapping the native
``load_into`` (its ``arrived`` callback runs on the load's thread), never by
timing: where a test needs the load to be mid-file, the wrapper holds it
there until the consumer has done what is checked."""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from dmaload import _dmaload  # noqa: E402
from dmaload.safetensors import _collective, iter_tensors  # noqa: E402

GUARD_S = 60  # a wait this long means the load or the consumer hung: fail


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


def _hold_after_first_arrival(
    monkeypatch: pytest.MonkeyPatch, then: Callable[[Callable[[int], Any]], None]
) -> dict[str, list[int]]:
    """Wraps the native ``load_into`` so that each load's first ``arrived``
    report is passed on, then ``then(arrived)`` runs on the load's thread
    before the load may report (or end) any further. Returns the reports
    seen, per file."""
    seen: dict[str, list[int]] = {}
    load_into = _dmaload.load_into

    def wrapped(path: str, target: Any, offset: int = 0, **kwargs: Any) -> Any:
        arrived = kwargs.pop("arrived")
        reports = seen.setdefault(os.path.realpath(path), [])

        def relay(n: int) -> None:
            reports.append(n)
            arrived(n)
            if len(reports) == 1:
                then(arrived)

        return load_into(path, target, offset, arrived=relay, **kwargs)

    monkeypatch.setattr(_collective._dmaload, "load_into", wrapped)
    return seen


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

    def hold(_arrived: Callable[[int], Any]) -> None:
        assert consumer_has_one.wait(GUARD_S), "the consumer got no tensor while the load was held"

    seen = _hold_after_first_arrival(monkeypatch, hold)
    reference = _reference(model)
    first = sorted(model.glob("*.safetensors"))[0]
    got = {}
    for name, t in iter_tensors(model):
        if reference[name].numel() and not consumer_has_one.is_set():
            # The first file's load has said only that its first bytes are in.
            held = seen[os.path.realpath(first)]
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

    def cut(_arrived: Callable[[int], Any]) -> None:
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
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that reported every byte and then failed (as its end check
    fails for a file written during it) raises before the next file's
    tensors, and also when it is the last file's."""
    load_into = _dmaload.load_into
    files = sorted(model.glob("*.safetensors"))
    reference = _reference(model)
    for failing in files:

        def failing_after(path: str, target: Any, offset: int = 0, _bad: Path = failing, **kwargs: Any) -> Any:
            report = load_into(path, target, offset, **kwargs)
            if os.path.realpath(path) == os.path.realpath(_bad):
                raise OSError(errno.ESTALE, "the file was written during the load", path)
            return report

        monkeypatch.setattr(_collective._dmaload, "load_into", failing_after)
        got = []
        with pytest.raises(_collective.CollectiveLoadError, match="written during the load"):
            for name, t in iter_tensors(model):
                assert _same_bytes(t, reference[name]), name
                got.append(name)
        later = [n for f in files[files.index(failing) + 1 :] for n in _names_in(f) if reference[n].numel()]
        assert not set(got) & set(later), failing


def _names_in(path: Path) -> list[str]:
    return [t.name for t in _dmaload.read_safetensors_header(str(path)).tensors]


def test_ctrl_c_reaches_a_consumer_waiting_for_bytes(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load is held after its first report until the consumer has
    left; SIGINT, sent then, must raise KeyboardInterrupt in the consumer
    waiting for later bytes (its wait holds no GIL and is interruptible),
    and leaving stops the load: no loader thread is left."""

    def interrupt_and_hold(arrived: Callable[[int], Any]) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        stop = arrived.__self__._stop  # type: ignore[attr-defined]  # the _Arrival's: set when the consumer leaves
        assert stop.wait(GUARD_S), "the consumer never left"

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
    assert not [t for t in threading.enumerate() if t.name == "dmaload-window-loader"]


def _stream(model: Path) -> _collective.Stream:
    return _collective.Stream(sorted(model.glob("*.safetensors")), recycle=True)


def test_a_stream_started_before_its_iteration_reads_then_hands_out_the_same_tensors(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a serving engine does while it builds its model: ``start()``
    reads before anyone asks for a tensor (the first bytes come in with no
    consumer), and the iteration then takes over those bytes."""
    first_bytes_in = threading.Event()
    _hold_after_first_arrival(monkeypatch, lambda _arrived: first_bytes_in.set())
    reference = _reference(model)
    stream = _stream(model)
    assert stream.arrived() == 0
    stream.start()
    assert first_bytes_in.wait(GUARD_S), "nothing was read before the iteration began"
    assert stream.arrived() > 0
    got = {name: t.clone() for name, t in stream}
    assert sorted(got) == sorted(reference)
    assert all(_same_bytes(got[n], reference[n]) for n in reference)
    assert not [t for t in threading.enumerate() if t.name == "dmaload-window-loader"]


def test_a_stream_started_and_closed_unread_stops_its_load_and_closes_its_files(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose model build fails closes the read it began: the load
    under way is cancelled (held here until the stream says stop), the
    thread is waited for and the files are closed."""
    held = threading.Event()

    def hold_until_stopped(arrived: Callable[[int], Any]) -> None:
        held.set()
        stop = arrived.__self__._stop  # type: ignore[attr-defined]  # the _Arrival's: set by close()
        assert stop.wait(GUARD_S), "close() never stopped the load"

    _hold_after_first_arrival(monkeypatch, hold_until_stopped)
    stream = _stream(model)
    fds = list(stream._fds)
    stream.start()
    assert held.wait(GUARD_S)
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "dmaload-window-loader"]
    for fd in fds:
        with pytest.raises(OSError) as closed:
            os.fstat(fd)
        assert closed.value.errno == errno.EBADF


def test_a_file_is_loaded_a_window_at_a_time_into_a_ring_of_three_buffers(
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
