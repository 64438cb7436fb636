"""Image identity: the key an image is stored under, its meta.json, and the check before restore.

A CRIU image restores exactly the process that was dumped, with its libraries, driver state and
credentials. Restoring it under a different engine, torch, driver, GPU model or user gives a
process that crashes or, worse, runs as someone else. So each image carries ``meta.json`` with
the identity it was made under and a sha256 over its files, and :func:`verify_before_restore`
compares both with the present before anything is restored.

Key: ``<model digest>-<engine config hash>-<identity hash>`` (shortened), so a change in any
of the three makes a new key instead of reusing a stale image.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from spswap import __version__
from spswap.checkpoint import criu
from spswap.fsutil import atomic_write_json, read_json

META_FILE = "meta.json"
META_VERSION = 1
# Files spswap writes next to CRIU's own: not part of what is restored, not hashed.
NOT_HASHED = frozenset({META_FILE, "dump.log"})
_CHUNK_BYTES = 8 << 20
PIECE_BYTES = 64 << 20  # unit of parallel hashing


@dataclass(frozen=True)
class Identity:
    """What an image depends on; every field must match before a restore."""

    engine: str
    engine_version: str
    torch: str
    python: str
    driver: str
    gpu_model: str
    criu_version: str
    model_digest: str
    uid: int
    config_hash: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Identity:
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def hash(self) -> str:
        """sha256 of the identity without the model and config (they are in the key apart)."""
        d = self.to_json()
        del d["model_digest"], d["config_hash"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


DIGEST_SEP = "+"


def parse_nvidia_version(text: str) -> str | None:
    """The driver version from ``/proc/driver/nvidia/version`` (e.g. ``"580.159.04"``)."""
    m = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def pool_digests(model_digest: str) -> list[str]:
    """The pool entries an image needs at restore (its processes map their files): one
    digest, or for a multi-model job each of its models' digests joined by ``+``."""
    return [d for d in model_digest.split(DIGEST_SEP) if d]


def config_hash(engine_config: dict[str, Any]) -> str:
    """sha256 of an engine config (canonical JSON: key order does not matter)."""
    return hashlib.sha256(json.dumps(engine_config, sort_keys=True).encode()).hexdigest()


def image_key(identity: Identity) -> str:
    """``<model digest>-<config hash>-<identity hash>``, 16+8+8 hex characters."""
    return f"{identity.model_digest[:16]}-{identity.config_hash[:8]}-{identity.hash()[:8]}"


def package_version(name: str) -> str:
    """Installed version of a distribution, without importing it (torch imports slowly)."""
    from importlib import metadata  # here: 10 ms that `spswap serve`'s start need not pay

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def process_identity(*, engine: str, engine_version: str, model_digest: str,
                     config_hash: str) -> dict[str, str]:  # fmt: skip
    """The identity fields a model process names itself: its engine, the torch and Python
    it runs on, its model and config (``engine_version`` defaults to spswap's)."""
    return {
        "engine": engine, "engine_version": engine_version or __version__,
        "torch": package_version("torch"), "python": platform.python_version(),
        "model_digest": model_digest, "config_hash": config_hash,
    }  # fmt: skip


@functools.lru_cache(maxsize=1)
def node_identity() -> dict[str, str]:
    """Driver version, GPU model and CRIU version of this node, the fields the daemon adds
    itself (read once, from files: no NVML, which costs seconds without persistence mode)."""
    try:
        driver = parse_nvidia_version(Path("/proc/driver/nvidia/version").read_text()) or "none"
    except OSError:
        driver = "none"
    gpu_model = "none"
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                gpu_model = line.split(":", 1)[1].strip()
                break
        break
    path = criu.find_criu()
    version = ".".join(map(str, criu.criu_version(path))) if path else "none"
    return {"driver": driver, "gpu_model": gpu_model, "criu_version": version}


def probe_identity(
    *, engine: str, engine_version: str, model_digest: str, engine_config: dict[str, Any],
    uid: int, gpu_model: str | None = None, driver: str | None = None,
    criu_version: str | None = None,
) -> Identity:  # fmt: skip
    """The whole identity of a process started here now; the node's fields come from
    :func:`node_identity` unless given."""
    node = node_identity()
    return Identity(
        uid=uid,
        **process_identity(engine=engine, engine_version=engine_version,
                           model_digest=model_digest, config_hash=config_hash(engine_config)),
        driver=driver or node["driver"], gpu_model=gpu_model or node["gpu_model"],
        criu_version=criu_version or node["criu_version"],
    )  # fmt: skip


def _piece_digest(path: Path, offset: int, size: int) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = size
        while left > 0 and (chunk := f.read(min(_CHUNK_BYTES, left))):
            h.update(chunk)
            left -= len(chunk)
    return h.digest()


def integrity_hash(image_dir: Path, *, threads: int | None = None) -> str:
    """sha256 over every image file's relative name, size and content, in name order.

    Each file is hashed in pieces of :data:`PIECE_BYTES` on several threads (hashlib lets
    go of the GIL), and the piece digests are hashed in order: a 1.6 GB image took 1.7-1.8 s
    with one thread on the H200 machine, a large share of a swap.
    """
    paths = sorted(
        p for p in image_dir.rglob("*") if p.is_file() and p.relative_to(image_dir).as_posix()
        not in NOT_HASHED
    )  # fmt: skip
    pieces = [
        (p, off, min(PIECE_BYTES, p.stat().st_size - off))
        for p in paths
        for off in range(0, max(p.stat().st_size, 1), PIECE_BYTES)
    ]
    workers = threads or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(lambda a: _piece_digest(*a), pieces))
    h = hashlib.sha256()
    it = iter(digests)
    for p in paths:
        rel = p.relative_to(image_dir).as_posix().encode()
        size = p.stat().st_size
        h.update(len(rel).to_bytes(4, "little") + rel + size.to_bytes(8, "little"))
        for _ in range(0, max(size, 1), PIECE_BYTES):
            h.update(next(it))
    return h.hexdigest()


def layout_hash(image_dir: Path) -> str:
    """sha256 over every image file's relative name and size (no content: cheap)."""
    h = hashlib.sha256()
    for p in sorted(p for p in image_dir.rglob("*") if p.is_file()):
        rel = p.relative_to(image_dir).as_posix()
        if rel not in NOT_HASHED:
            h.update(len(rel).to_bytes(4, "little") + rel.encode()
                     + p.stat().st_size.to_bytes(8, "little"))  # fmt: skip
    return h.hexdigest()


def write_meta(image_dir: Path, identity: Identity) -> dict[str, Any]:
    """Write ``meta.json`` (identity, integrity hash, layout hash) into a finished image;
    returns it."""
    meta = {
        "version": META_VERSION, "key": image_dir.name, "identity": identity.to_json(),
        "sha256": integrity_hash(image_dir), "layout": layout_hash(image_dir),
        "created_at": time.time(),
    }  # fmt: skip
    atomic_write_json(image_dir / META_FILE, meta, mode=0o600)
    return meta


def read_meta(image_dir: Path) -> dict[str, Any] | None:
    """The image's meta.json, or None when it has none."""
    meta = read_json(image_dir / META_FILE)
    return meta if isinstance(meta, dict) else None


def _record_problem(image_dir: Path) -> tuple[str | None, dict[str, Any]]:
    """Its owner and modes (when we are root), its meta.json and that record's version:
    (what is wrong or None, the meta)."""
    try:
        st = image_dir.stat()
    except FileNotFoundError:
        return f"no image at {image_dir}", {}
    if os.geteuid() == 0 and (st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        return (f"{image_dir} is not owned by root or is writable by others: only images "
                "the daemon dumped itself are restored"), {}  # fmt: skip
    meta = read_meta(image_dir)
    if meta is None or "identity" not in meta:
        return f"{image_dir} has no {META_FILE}: not a complete spswap image", {}
    if meta.get("version") != META_VERSION:
        return (f"{image_dir}/{META_FILE} has version {meta.get('version')}, expected "
                f"{META_VERSION}"), meta  # fmt: skip
    return None, meta


def files_problem(image_dir: Path) -> str | None:
    """What makes a restore refuse this image whatever its job (its owner and modes, its
    record, its files' names and sizes against the record), or None. No byte of the
    image is read: for `spswap images ls`."""
    problem, meta = _record_problem(image_dir)
    if problem is None and meta.get("layout") and layout_hash(image_dir) != meta["layout"]:
        problem = (f"{image_dir} changed since it was dumped (a file is missing, added or "
                   "of another size)")  # fmt: skip
    return problem


def verify_before_restore(
    image_dir: Path, expected: Identity, *, check_integrity: bool = True,
    read_content: bool = True,
) -> str | None:  # fmt: skip
    """None when the image may be restored here; otherwise the reason it may not.

    Checks, in order: the image exists and (when we are root) is owned by root and writable
    by nobody else; meta.json is there; every identity field matches; and, unless
    ``check_integrity`` is off, its files: with ``read_content`` every byte hashes as
    recorded (it reads the whole image), without it every file is there with its recorded
    size (no file missing, added or cut short; an image recorded before the layout hash
    existed is read whole).
    """
    problem, meta = _record_problem(image_dir)
    if problem is not None:
        return problem
    recorded = meta["identity"]
    diffs = [
        f"{f.name}: image {recorded.get(f.name)!r}, here {getattr(expected, f.name)!r}"
        for f in fields(Identity) if recorded.get(f.name) != getattr(expected, f.name)
    ]  # fmt: skip
    if diffs:
        return "the image was made under another identity (" + "; ".join(diffs) + ")"
    if check_integrity and not read_content and meta.get("layout"):
        if layout_hash(image_dir) != meta["layout"]:
            return (f"{image_dir} changed since it was dumped (a file is missing, added or "
                    "of another size)")  # fmt: skip
    elif check_integrity:
        actual = integrity_hash(image_dir)
        if actual != meta.get("sha256"):
            return f"{image_dir} changed since it was dumped (sha256 {actual[:12]} != recorded)"
    return None
