"""The header is untrusted: every malformed file is a SafetensorError that
says what is wrong; never a crash, a hang or a huge allocation."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from malformed_cases import CASES, VALID

import dmaload
import dmaload.safetensors as dst
from dmaload import _dmaload

FUZZ_CORPUS = Path(__file__).resolve().parents[3] / "fuzz" / "corpus" / "safetensors_header"


def bytes_read() -> int:
    """Bytes this process has read with read(2) and the like (/proc's rchar)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


@pytest.mark.parametrize("name,data,expected", CASES, ids=[c[0] for c in CASES])
def test_malformed_file_is_a_safetensor_error(tmp_path: Path, name: str, data: bytes, expected: str) -> None:
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(data)
    valid = tmp_path / "valid.safetensors"
    valid.write_bytes(VALID[0][1])
    for framework in ("np", "pt"):
        dst.load_file(valid, framework=framework)  # type: ignore[arg-type]  # imports done before counting
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    read_before = bytes_read()
    for framework in ("np", "pt"):
        with pytest.raises(dmaload.SafetensorError) as err:
            dst.load_file(path, framework=framework)  # type: ignore[arg-type]
        assert expected in str(err.value), str(err.value)
        assert str(path) in str(err.value)
    with pytest.raises(dmaload.SafetensorError, match=expected.replace("(", r"\(")):
        _dmaload.parse_safetensors_header(data)
    # A header that lies about sizes makes nothing read past the file: the
    # two loads read at most the file twice each, and a little besides.
    assert bytes_read() - read_before < 4 * len(data) + (1 << 20)
    # No allocation anywhere near what a lying header asks for (ru_maxrss in KiB).
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 * 1024


def test_errors_name_the_offset() -> None:
    for name, data, _ in CASES:
        if name in ("gap", "overlap", "shape_dtype_mismatch", "header_len_past_eof", "not_utf8"):
            with pytest.raises(dmaload.SafetensorError, match=r"at byte \d+"):
                _dmaload.parse_safetensors_header(data)


def test_safetensor_error_is_a_value_error() -> None:
    assert issubclass(dmaload.SafetensorError, ValueError)


@pytest.mark.parametrize("name,data", VALID, ids=[v[0] for v in VALID])
def test_valid_edge_cases_parse(tmp_path: Path, name: str, data: bytes) -> None:
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(data)
    header = _dmaload.parse_safetensors_header(data)
    out = dst.load_file(path)
    assert set(out) == {t.name for t in header.tensors}


def test_safetensors_package_agrees(tmp_path: Path) -> None:
    """Every case the reference implementation can judge, it rejects too
    (duplicate names and rank are checks of our own; it keeps the last
    duplicate and has no rank limit)."""
    safetensors = pytest.importorskip("safetensors")
    ours_only = {"duplicate_name", "metadata_duplicate_key", "rank_65", "many_dims_in_huge_list", "starts_with_space"}
    for name, data, _ in CASES:
        if name in ours_only:
            continue
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(Exception):
            with safetensors.safe_open(path, framework="np") as f:
                for k in f.keys():
                    f.get_tensor(k)


def test_committed_fuzz_corpus_never_crashes() -> None:
    files = sorted(FUZZ_CORPUS.glob("*")) if FUZZ_CORPUS.is_dir() else []
    if not files:
        pytest.skip(f"no fuzz corpus at {FUZZ_CORPUS}")
    for f in files:
        data = f.read_bytes()
        try:
            _dmaload.parse_safetensors_header(data)
        except dmaload.SafetensorError:
            pass
