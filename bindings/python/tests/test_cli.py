"""``python -m dmaload``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dmaload.__main__ import native_cli


def run(*args: str, python_cli: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if python_cli:
        env["DMALOAD_PYTHON_CLI"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "dmaload", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_python_cli_load_json(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    out = run("load", str(path), "--json", "--offset", "1K", "--length", "4097")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bytes"] == 4097 and report["offset"] == 1024
    # The command's report shows the page cache unless told not to.
    assert set(report["page_cache"]) == {"resident_bytes", "fraction"}
    out = run("load", str(path), "--json", "--no-page-cache")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["page_cache"] is None


def test_python_cli_load_text_and_errors(data_file: tuple[Path, bytes], tmp_path: Path) -> None:
    path, _ = data_file
    out = run("load", str(path), "--engine", "pread-pool", "--mode", "buffered")
    assert out.returncode == 0 and "pread-pool" in out.stdout
    assert "cache    3145851 bytes resident after the load (100.0%)" in out.stdout
    out = run("load", str(path), "--no-page-cache")
    assert out.returncode == 0 and "resident after the load" not in out.stdout
    out = run("load", str(tmp_path / "missing"))
    assert out.returncode == 1 and "No such file" in out.stderr
    out = run("info")
    assert out.returncode == 2 and "native dmaload CLI" in out.stderr
    # The benchmarks are their own binary: this implementation names it, as
    # the native `dmaload bench` does.
    out = run("bench", "load", "f")
    assert out.returncode == 2 and "dmaload-bench load f" in out.stderr


def test_tensors_subcommand(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "m.safetensors"
    st.save_file({"w": np.zeros((2, 3), np.float32)}, path)
    out = run("tensors", str(path), "--json", python_cli=False)  # always the Python implementation
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tensors"] == [{"name": "w", "dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08" + b"\x00" * 7 + b"[]      ")
    out = run("tensors", str(bad))
    assert out.returncode == 1 and "start with" in out.stderr


def test_native_cli_is_executed_when_found(data_file: tuple[Path, bytes]) -> None:
    if native_cli() is None:
        pytest.skip("native dmaload CLI not built (set DMALOAD_CLI or put it on PATH)")
    path, _ = data_file
    out = run("load", str(path), "--json", python_cli=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["bytes"] == path.stat().st_size
    assert run("--help", python_cli=False).returncode == 0
