"""Celery's test tree, from the sdist of the installed Celery on PyPI, cached on disk.

The sdist is fetched with pip (so an index configured for pip is used) and only its
``t/`` directory and its pytest configuration (``pyproject.toml``) are extracted, into
``<cache>/celery-<version>/``. Nothing of Celery's package source is extracted: the tests
import the installed ``celery``. A second call finds the extracted tree and needs no
network. The cache is ``.cache/celery-suite/`` in the repository (gitignored), or
``$CELERY_SUITE_CACHE``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from bench.celery_suite import ROOT

__all__ = ["CACHE_ENV", "SdistError", "celery_tests", "default_cache", "installed_celery"]

#: Environment variable naming the cache directory.
CACHE_ENV = "CELERY_SUITE_CACHE"

#: Files of the sdist root kept beside ``t/``: Celery's pytest settings.
_CONFIG_FILES = ("pyproject.toml", "pytest.ini", "setup.cfg")

_DOWNLOAD_TIMEOUT_S = 300


class SdistError(RuntimeError):
    """The sdist could not be fetched, or holds no integration tests."""


def installed_celery() -> str:
    """Version of the Celery installed in this interpreter."""
    return metadata.version("celery")


def default_cache() -> Path:
    """``$CELERY_SUITE_CACHE``, else ``.cache/celery-suite`` in the repository."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else ROOT / ".cache" / "celery-suite"


def celery_tests(version: str | None = None, cache: Path | None = None) -> Path:
    """Directory holding Celery ``version``'s ``t/`` (default: the installed version).

    :raises SdistError: when pip cannot fetch the sdist or it has no ``t/integration``.
    """
    version = version or installed_celery()
    cache = cache or default_cache()
    target = cache / f"celery-{version}"
    if (target / "t" / "integration" / "conftest.py").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    archive = _download(version, cache)
    staging = Path(tempfile.mkdtemp(prefix=f".celery-{version}-", dir=cache))
    try:
        _extract(archive, version, staging)
        try:
            staging.rename(target)
        except OSError:  # extracted meanwhile by another run
            if not (target / "t" / "integration" / "conftest.py").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _download(version: str, cache: Path) -> Path:
    archive = cache / f"celery-{version}.tar.gz"
    if archive.is_file():
        return archive
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as dest:
        command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                   "--no-deps", "--disable-pip-version-check", "--quiet",
                   "--dest", dest, f"celery=={version}"]
        try:
            proc = subprocess.run(command, capture_output=True, text=True,
                                  timeout=_DOWNLOAD_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise SdistError(f"pip download of celery=={version} took over "
                             f"{_DOWNLOAD_TIMEOUT_S} s") from exc
        if proc.returncode != 0:
            raise SdistError(f"`{' '.join(command)}` failed:\n{proc.stderr[-3000:]}")
        found = sorted(Path(dest).glob("celery-*.tar.gz"))
        if not found:
            raise SdistError(f"pip download of celery=={version} saved no .tar.gz sdist")
        os.replace(found[0], archive)
    return archive


def _extract(archive: Path, version: str, staging: Path) -> None:
    """Extract ``t/`` and the pytest configuration of ``archive`` into ``staging``."""
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        roots = {m.name.split("/", 1)[0] for m in members}
        if len(roots) != 1:
            raise SdistError(f"{archive.name}: expected one top directory, found {roots}")
        root = roots.pop()
        kept = []
        for member in members:
            relative = member.name[len(root) + 1:]
            if not (relative.startswith("t/") or relative in _CONFIG_FILES):
                continue
            if not (member.isfile() or member.isdir()):
                continue  # links and devices: a test tree needs none
            if ".." in Path(relative).parts:
                raise SdistError(f"{archive.name}: unsafe member {member.name!r}")
            member.name = relative
            kept.append(member)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(staging, members=kept, filter="data")
        else:  # Python < 3.10.12: the members were checked above
            tar.extractall(staging, members=kept)
    if not (staging / "t" / "integration" / "conftest.py").is_file():
        raise SdistError(f"{archive.name} (celery {version}) has no t/integration/")
