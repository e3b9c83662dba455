"""Runs safetensors' own Python tests against dmaload.safetensors (see
redirect.py, their conftest.py): the tests of the installed safetensors release, taken from
its source distribution on PyPI (checked against PyPI's SHA-256, kept in
~/.cache/dmaload), each file of them whose framework is installed.

    python upstream_safetensors/run.py [pytest args]

Without the network and without a cached copy it prints SKIP and exits 0.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Test files of safetensors' Python bindings that need a framework beside
# torch and numpy, and that framework's module.
NEEDS = {
    "test_flax_comparison.py": "flax",
    "test_mlx_comparison.py": "mlx",
    "test_paddle_comparison.py": "paddle",
    "test_tf_comparison.py": "tensorflow",
}


def fetch_json(url: str, accept: str = "application/json") -> dict[str, object]:
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=60) as response:
        data: dict[str, object] = json.load(response)
    return data


def upstream_tests(version: str) -> Path:
    """The directory of the release's Python tests, fetched once: the
    release's source distribution found through PyPI's simple index (the
    API pip uses), checked against the SHA-256 the index gives."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dmaload" / f"safetensors-{version}-tests"
    if cache.is_dir():
        return cache
    index = fetch_json("https://pypi.org/simple/safetensors/", "application/vnd.pypi.simple.v1+json")
    files = index["files"]
    assert isinstance(files, list)
    (sdist,) = [f for f in files if f["filename"] == f"safetensors-{version}.tar.gz"]
    with urllib.request.urlopen(sdist["url"], timeout=120) as response:
        archive = response.read()
    digest = hashlib.sha256(archive).hexdigest()
    if digest != sdist["hashes"]["sha256"]:
        raise SystemExit(f"{sdist['url']}: SHA-256 {digest}, PyPI says {sdist['hashes']['sha256']}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{cache.name}-", dir=cache.parent))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and parts[1:4] == ("bindings", "python", "tests") and len(parts) >= 5:
                target = partial.joinpath(*parts[4:])
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                target.write_bytes(source.read())
    partial.rename(cache)
    return cache


def main() -> int:
    version = importlib.metadata.version("safetensors")
    try:
        tests = upstream_tests(version)
    except OSError as exc:
        print(f"SKIP upstream safetensors tests: safetensors {version}'s tests are not cached and PyPI is out of reach ({exc})")
        return 0
    try:
        info = fetch_json("https://pypi.org/pypi/safetensors/json")["info"]
        newest = info.get("version") if isinstance(info, dict) else None
    except OSError as exc:
        newest = f"unknown ({exc})"
    print(f"upstream safetensors tests: safetensors {version} installed, the newest on PyPI is {newest}")
    files = sorted(p.name for p in tests.glob("test_*.py") if importlib.util.find_spec(NEEDS.get(p.name, "os")) is not None)
    with tempfile.TemporaryDirectory(prefix="dmaload-upstream-") as work:
        # Laid out as in safetensors' tree: the tests run from
        # bindings/python and write their files to ./ and ./tests/data.
        shutil.copytree(tests, Path(work) / "tests")
        shutil.copy(HERE / "redirect.py", Path(work) / "conftest.py")
        paths = [f"tests/{name}" for name in files]
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths, *sys.argv[1:]]
        return subprocess.call(command, cwd=work)


if __name__ == "__main__":
    sys.exit(main())
