"""The Python options are the core's: the same names, the same values, the
same defaults (``dmaload::LoadOptions``, ``Engine::ALL``, ``IoMode::ALL``,
``Destination::forms()``, the ``DEFAULT_*`` constants), as the native
module reports them."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

import dmaload
from dmaload import _dmaload, _options
from dmaload._options import DEVICE_DESTINATIONS, DMABUF_DESTINATIONS, Destination, Engine, LoadOptions, Mode


def test_enumerated_options_take_the_cores_values_in_its_order() -> None:
    choices = _dmaload._option_choices()
    assert set(choices) == {"engine", "mode", "to"}
    assert list(get_args(Engine)) == choices["engine"]
    assert list(get_args(Mode)) == choices["mode"]
    # Host memory kinds first, then the dma-buf and device forms, which dmaload.load refuses.
    assert [*get_args(Destination), *DMABUF_DESTINATIONS, *DEVICE_DESTINATIONS] == choices["to"]


def test_option_names_and_defaults_are_the_cores() -> None:
    defaults = _dmaload._option_defaults()
    assert set(LoadOptions.__annotations__) == set(defaults)
    assert defaults["engine"] in get_args(Engine) and defaults["engine"] == "uring-fixed"
    assert defaults["mode"] in get_args(Mode) and defaults["mode"] == "auto"
    assert defaults["to"] in get_args(Destination) and defaults["to"] == "auto"
    # What LoadOptions' docstring promises.
    expected = {
        "gather_size": 128 << 20,
        "chunk_size": 4 << 20,
        "queue_depth": 32,
        "threads": 8,
        "staging_slots": 32,
        "staging_slot_size": 16 << 20,
    }
    assert {k: defaults[k] for k in expected} == expected
    assert isinstance(defaults["populate_threads"], int) and 1 <= defaults["populate_threads"] <= 4
    assert defaults["measure_page_cache"] is False
    doc = LoadOptions.__doc__ or ""
    for name in LoadOptions.__annotations__:
        assert name in doc, f"LoadOptions' docstring does not describe {name}"
    promised = (
        '``"uring-fixed"``',
        '``"memfd"``',
        "128 MiB and 4 MiB",
        "default 32)",
        "default 8)",
        "slots of 16 MiB",
        "at most 32)",
        "default ``False``",
    )
    for text in promised:
        assert text in doc, text


def test_a_load_without_options_uses_the_cores_defaults(
    data_file: tuple[Path, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = data_file
    # No depth remembered for the disk (a direct load would start there).
    monkeypatch.setenv("DMALOAD_CACHE_DIR", str(tmp_path / "cache"))
    defaults = _dmaload._option_defaults()
    with dmaload.load(path) as buf:
        report = buf.report
        # auto chose a memory kind with an fd (a plain load may share it) and says why.
        assert report.engine == defaults["engine"] and defaults["to"] == "auto"
        assert report.memory in ("memfd", "memfd-huge", "hugetlb") and report.memory_reason
        assert report.destination == report.memory == buf.memory
        assert os.readlink(f"/proc/self/fd/{buf.fileno()}").startswith("/memfd:")
        assert (report.chunk_size, report.queue_depth) == (defaults["chunk_size"], defaults["queue_depth"])


@pytest.mark.parametrize("to", get_args(Destination))
def test_every_host_destination_loads(data_file: tuple[Path, bytes], to: Destination) -> None:
    path, data = data_file
    try:
        buf = dmaload.load_range(path, 3, 1000, to=to)
    except OSError as e:
        # memfd-huge and hugetlb where the kernel cannot give them: the
        # error says what an administrator could change.
        assert to in ("memfd-huge", "hugetlb") and e.errno == errno.EINVAL, e
        assert "shmem_enabled" in str(e) or "nr_hugepages" in str(e), e
        pytest.skip(f"{to}: {e}")
    with buf:
        assert buf.report.destination == buf.memory
        # dmaload.load keeps an fd, so auto never chooses anonymous memory.
        assert buf.memory == to if to != "auto" else not buf.memory.startswith("anonymous")
        assert bytes(memoryview(buf)) == data[3:1003]


@pytest.mark.parametrize("to", ["cuda:0", "cuda", "cuda:3"])
def test_a_device_destination_is_the_cores_error(data_file: tuple[Path, bytes], to: str) -> None:
    path, _ = data_file
    with pytest.raises(OSError) as e:
        dmaload.load(path, to=to)  # type: ignore[arg-type]
    assert e.value.errno == errno.EINVAL
    assert "cannot live on a device" in str(e.value) and "dmaload load --to cuda:" in str(e.value)
    with pytest.raises(ValueError, match="invalid device"):
        dmaload.load(path, to="cuda:x")  # type: ignore[arg-type]


def test_safetensors_loaders_take_device_not_a_device_destination(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "m.safetensors"
    st.save_file({"w": np.arange(6, dtype=np.float32)}, path)
    from dmaload.safetensors import load_file

    with pytest.raises(ValueError, match="device="):
        load_file(path, to="cuda:0")  # type: ignore[arg-type]
    tensors = load_file(path, to="anonymous-thp")
    assert tensors["w"].tolist() == list(range(6))


def test_native_options_are_one_checked_dict(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    native = _options.native_options({"gather_size": "1M", "staging_slot_size": "64K", "engine": "read"})
    assert native == {"gather_size": 1 << 20, "staging_slot_size": 64 << 10, "engine": "read"}
    with pytest.raises(TypeError, match="unknown load option"):
        _options.native_options({"gather": 1})
    # The native side checks the names and types again, naming the option.
    with pytest.raises(TypeError, match="unknown load option \"gather\""):
        _dmaload.load(path, options={"gather": 1})
    with pytest.raises(TypeError, match="load option queue_depth"):
        _dmaload.load(path, options={"queue_depth": "deep"})
    with pytest.raises(TypeError, match="takes no 'to'"):
        dmaload.load_into(path, bytearray(10), to="memfd")  # type: ignore[call-arg]
    # None is the default, and a host load ignores the staging ring.
    with _dmaload.load(path, options={"engine": None, "staging_slots": 2}) as buf:
        assert bytes(memoryview(buf)) == data


@pytest.mark.parametrize(
    ("ring", "error"),
    [
        ({"staging_slots": 1}, "staging slots 1 must be at least 2"),
        ({"staging_slot_size": "2G"}, "staging slot size 2147483648 must be between 1 byte and 1 GiB"),
    ],
)
def test_the_staging_ring_is_the_cores_option(data_file: tuple[Path, bytes], ring: LoadOptions, error: str) -> None:
    """The staging ring's options are checked by the core, as the command
    line's and C's are, in the same words: on a host load (which takes no
    ring) and on a staged load, before its ring is made."""
    path, _ = data_file
    with pytest.raises(OSError, match=error) as e:
        dmaload.load(path, **ring)
    assert e.value.errno == errno.EINVAL
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    model = path.with_name("m.safetensors")
    st.save_file({"w": np.arange(6, dtype=np.float32)}, model)
    from dmaload.safetensors import _device

    with pytest.raises(OSError, match=error) as e:
        _device.load_files([model], "cpu", None, dict(ring))
    assert e.value.errno == errno.EINVAL


def _python_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DMALOAD_PYTHON_CLI": "1"}
    command = [sys.executable, "-m", "dmaload", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_python_cli_takes_to_with_the_host_choices(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    out = _python_cli("load", str(path), "--to", "anonymous-thp", "--json")
    assert out.returncode == 0, out.stderr
    assert '"memory":"anonymous-thp"' in out.stdout
    out = _python_cli("load", str(path), "--to", "cuda:0")
    assert out.returncode == 2 and "invalid choice" in out.stderr
    assert "needs the native dmaload CLI" in " ".join(_python_cli("load", "--help").stdout.split())
    assert _python_cli("load", str(path), "--memory", "memfd").returncode == 2


@pytest.mark.parametrize("option", ["queue_depth", "threads", "populate_threads", "staging_slots", "chunk_size"])
def test_a_bool_is_not_a_count(data_file: tuple[Path, bytes], option: str) -> None:
    """True is an int to Python, but never the count 1 a user meant: the
    native side refuses it, naming the option, as parse_size does."""
    path, _ = data_file
    with pytest.raises(TypeError, match=f"load option {option}: .*bool"):
        _dmaload.load(path, options={option: True})


def test_the_safetensors_concurrency_is_checked_by_name(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "m.safetensors"
    st.save_file({"w": np.arange(6, dtype=np.float32)}, path)
    from dmaload.safetensors import load_file, safe_open

    for load in (load_file, safe_open):
        for bad, error in ((-1, ValueError), (0, ValueError), ("2", TypeError), (True, TypeError), (2.0, TypeError)):
            with pytest.raises(error, match="concurrency"):
                load(path, concurrency=bad)  # type: ignore[arg-type]
