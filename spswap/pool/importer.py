"""``spswap pool import``: read a safetensors checkpoint once into one pool entry.

Order of work, so that bad input never touches the pool: resolve and validate every
header first; then, under a lock per source (so a second importer of the same files
waits and reuses the first one's entry), reuse an entry imported from the very same
files (path, size, mtime) without reading any data, or copy every tensor into a new
entry through :class:`~spswap.pool.writer.EntryWriter`.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

from filelock import FileLock

from spswap.errors import InvalidCheckpoint
from spswap.pool.copy import Range, ShortRead, hash_ranges
from spswap.pool.index import PoolIndex, source_key
from spswap.pool.layout import LOCK_MODE, import_lock_name
from spswap.pool.manifest import Manifest, SourceFile, padded_size_bytes
from spswap.pool.safetensors_format import (
    HEADER_LEN_BYTES,
    INDEX_FILE,
    Checkpoint,
    SafetensorsFile,
    parse_header,
    parse_header_length,
    resolve_checkpoint,
)
from spswap.pool.writer import EntryWriter


class ImportTarget(Protocol):
    """What an import needs from the pool (:class:`~spswap.pool.store.Pool` is one)."""

    @property
    def index(self) -> PoolIndex: ...

    def ensure_dirs(self) -> None:
        """Make the pool and lock directories."""
        ...

    def find_by_sources(self, sources: Sequence[SourceFile]) -> Manifest | None:
        """The entry imported from exactly these files, or None."""
        ...

    def remember_sources(self, sources: Sequence[SourceFile], digest: str) -> None:
        """Record that these files hold ``digest``."""
        ...

    def writer(
        self, name: str, *, identity: dict[str, Any] | None = None,
        sources: Sequence[SourceFile] = (), expected_size_bytes: int | None = None,
    ) -> EntryWriter:  # fmt: skip
        """A writer for one new entry."""
        ...


def import_checkpoint(
    pool: ImportTarget, path: Path, *, name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    identity: dict[str, Any] | None = None,
) -> Manifest:  # fmt: skip
    """Import ``path`` (a .safetensors file or a checkpoint directory); returns its
    manifest. ``identity`` is recorded in a new entry (see ``access.import_model``)."""
    ckpt = resolve_checkpoint(path)

    def fill(w: EntryWriter) -> None:
        _copy(ckpt, w, progress)
        _check_unchanged(ckpt)

    return _import_once(pool, ckpt, name or ckpt.name, fill, identity)


def _import_once(
    pool: ImportTarget,
    ckpt: Checkpoint,
    name: str,
    fill: Callable[[EntryWriter], None],
    identity: dict[str, Any] | None = None,
) -> Manifest:
    """One entry per source set, however many processes import it at once: under the
    source's lock, reuse what an earlier import made; else ``fill`` a new entry."""
    sources = ckpt.sources
    pool.ensure_dirs()
    with FileLock(str(pool.index.lock_path(import_lock_name(source_key(sources)))), mode=LOCK_MODE):
        hit = pool.find_by_sources(sources)
        if hit is not None:
            return hit
        expected = padded_size_bytes(t.size_bytes for _f, t in ckpt.tensors)
        with pool.writer(
            name, sources=sources, expected_size_bytes=expected, identity=identity
        ) as w:
            fill(w)
        assert w.manifest is not None
        pool.remember_sources(sources, w.manifest.digest)
        return w.manifest


def _copy(
    ckpt: Checkpoint, w: EntryWriter, progress: Callable[[int, int], None] | None,
    given_fds: dict[Path, int] | None = None,
) -> None:  # fmt: skip
    with ExitStack() as stack:
        fds: dict[Path, int] = dict(given_fds or {})
        for f in ckpt.files:
            if f.path not in fds:
                fds[f.path] = os.open(f.path, os.O_RDONLY)
                stack.callback(os.close, fds[f.path])
        names: dict[int, str] = {fd: str(p) for p, fd in fds.items()}
        ranges = []
        for f, t in ckpt.tensors:
            offset, _size = w.place(t.name, t.dtype, t.shape)
            ranges.append(Range(t.name, fds[f.path], t.file_offset, t.size_bytes, offset))
        try:
            dst = w.data_view() if ranges and w.expected_size_bytes else None
            checksums = hash_ranges(ranges, dst=dst, progress=progress)
        except ShortRead as e:
            raise InvalidCheckpoint(
                f"{names[e.fd]}: ends at byte {e.offset}, before the data its header "
                "describes (truncated while importing); check the file and import again"
            ) from None
        for _f, t in ckpt.tensors:
            w.commit(t.name, checksums[t.name])


def _check_unchanged(ckpt: Checkpoint) -> None:
    for s in ckpt.sources:
        try:
            st = os.stat(s.path)
        except FileNotFoundError:
            raise InvalidCheckpoint(f"{s.path}: removed while importing; import again") from None
        if (st.st_size, st.st_mtime_ns) != (s.size_bytes, s.mtime_ns):
            raise InvalidCheckpoint(
                f"{s.path}: changed while importing (size or mtime differ); import again "
                "once nothing writes to it"
            )


# -- import from descriptors the caller opened (the daemon's path for users) -----------

MAX_FD_INDEX_BYTES = 64 << 20
MAX_NAME_CHARS = 200


def import_from_fds(
    pool: ImportTarget, files: Sequence[tuple[str, int]], *, name: str | None = None,
    owner_uid: int, progress: Callable[[int, int], None] | None = None,
    identity: dict[str, Any] | None = None,
) -> Manifest:  # fmt: skip
    """Import a checkpoint from open descriptors: ``files`` is ``(relative name, fd)`` pairs.

    This is how the root daemon imports for a user: the user opened the files, so only
    what the user can read gets in. Nothing is ever reopened by path (a path could be
    swapped for a symlink to a file the user cannot read). The names say what each file
    is: one ``*.safetensors`` file, or ``model.safetensors.index.json`` plus every shard
    its weight_map names. Every header is validated as for a path import. The fds stay
    the caller's to close. ``owner_uid`` keys the source aliases, so one user's files
    never stand in for another's.
    """
    ckpt, by_path = checkpoint_from_fds(files, name=name, owner_uid=owner_uid)

    def fill(w: EntryWriter) -> None:
        _copy(ckpt, w, progress, by_path)
        for f in ckpt.files:
            _check_fd_unchanged(f.path, by_path[f.path], f.size_bytes, f.mtime_ns)

    return _import_once(pool, ckpt, ckpt.name, fill, identity)


def checkpoint_from_fds(
    files: Sequence[tuple[str, int]], *, name: str | None, owner_uid: int
) -> tuple[Checkpoint, dict[Path, int]]:
    """Validate names and descriptors and read every header; the checkpoint and the fd of
    each of its files (keyed by the file's source path)."""
    if not files:
        raise InvalidCheckpoint("no files given; pass a .safetensors file or a checkpoint dir")
    names = [n for n, _ in files]
    for n in names:
        _check_rel_name(n)
    if len(set(names)) != len(names):
        raise InvalidCheckpoint(f"file names repeat in {names}; send each file once")
    if name is not None and not (0 < len(name) <= MAX_NAME_CHARS and name.isprintable()):
        raise InvalidCheckpoint(f"entry name {name!r} must be 1..{MAX_NAME_CHARS} printable "
                                "characters")  # fmt: skip
    stats = {n: _check_fd(n, fd) for n, fd in files}
    fd_of = dict(files)

    def key(n: str) -> Path:
        st = stats[n]
        return Path(f"/fd-import/uid{owner_uid}/dev{st.st_dev}-ino{st.st_ino}/{n}")

    shard_names = [n for n in names if n.endswith(".safetensors")]
    index_names = [n for n in names if n == INDEX_FILE]
    if len(shard_names) + len(index_names) != len(names):
        odd = sorted(set(names) - set(shard_names) - set(index_names))
        raise InvalidCheckpoint(f"unexpected files {odd}: send *.safetensors files and at most "
                                f"one {INDEX_FILE}")  # fmt: skip
    if not shard_names:
        raise InvalidCheckpoint("no .safetensors file among the files sent")
    shards = tuple(_read_fd_safetensors(fd_of[n], key(n), stats[n]) for n in shard_names)
    by_path = {key(n): fd_of[n] for n in shard_names}
    extra: tuple[SourceFile, ...] = ()
    if index_names:
        _check_weight_map(_read_fd_json(fd_of[INDEX_FILE], stats[INDEX_FILE]), shards)
        st = stats[INDEX_FILE]
        extra = (SourceFile(str(key(INDEX_FILE)), st.st_size, st.st_mtime_ns),)
    elif len(shards) != 1:
        raise InvalidCheckpoint(f"{len(shards)} .safetensors files but no {INDEX_FILE}; send "
                                "one file, or the index with its shards")  # fmt: skip
    default = Path(shard_names[0]).stem if len(shards) == 1 and not index_names else "model"
    ckpt = Checkpoint(Path("/fd-import"), name or default, shards, extra)
    return ckpt, by_path


def _check_rel_name(n: str) -> None:
    if not n or len(n) > 255 or "/" in n or "\0" in n or n in (".", "..") or not n.isprintable():
        raise InvalidCheckpoint(f"file name {n!r} is not a plain file name (no '/', '..' or "
                                "control characters)")  # fmt: skip


def _check_fd(n: str, fd: int) -> os.stat_result:
    try:
        st = os.fstat(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise InvalidCheckpoint(f"{n}: descriptor unusable ({e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidCheckpoint(f"{n}: not a regular file; send the checkpoint's files")
    if flags & getattr(os, "O_PATH", 0) or (flags & os.O_ACCMODE) == os.O_WRONLY:
        raise InvalidCheckpoint(f"{n}: descriptor not opened for reading; open it with O_RDONLY")
    return st


def _read_fd_safetensors(fd: int, path: Path, st: os.stat_result) -> SafetensorsFile:
    name = path.name
    prefix = os.pread(fd, HEADER_LEN_BYTES, 0)
    header_len = parse_header_length(prefix, st.st_size, name=name)
    header = os.pread(fd, header_len, HEADER_LEN_BYTES)
    if len(header) != header_len:
        raise InvalidCheckpoint(f"{name}: file shrank while its header was read; import again")
    tensors, metadata = parse_header(header, st.st_size, name=name)
    return SafetensorsFile(path, st.st_size, st.st_mtime_ns, HEADER_LEN_BYTES + header_len,
                           tensors, metadata)  # fmt: skip


def _read_fd_json(fd: int, st: os.stat_result) -> Any:
    if st.st_size > MAX_FD_INDEX_BYTES:
        raise InvalidCheckpoint(f"{INDEX_FILE}: {st.st_size} bytes, more than an index needs")
    raw = os.pread(fd, st.st_size, 0)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidCheckpoint(f"{INDEX_FILE}: not JSON ({e}); re-download it") from None


def _check_weight_map(obj: Any, shards: Sequence[SafetensorsFile]) -> None:
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InvalidCheckpoint(f"{INDEX_FILE}: has no weight_map (tensor name -> shard file)")
    by_shard = {s.path.name: {t.name for t in s.tensors} for s in shards}
    wanted = {str(v) for v in weight_map.values()}
    if wanted != set(by_shard):
        raise InvalidCheckpoint(
            f"{INDEX_FILE}: its weight_map names shards {sorted(wanted)} but "
            f"{sorted(by_shard)} were sent; send exactly the shards it names"
        )
    for tensor, shard in weight_map.items():
        if tensor not in by_shard[str(shard)]:
            raise InvalidCheckpoint(f"{INDEX_FILE}: tensor {tensor!r} is mapped to {shard} "
                                    "but that shard lacks it")  # fmt: skip
    seen: dict[str, str] = {}
    for s in shards:
        for t in s.tensors:
            if t.name in seen:
                raise InvalidCheckpoint(
                    f"tensor {t.name!r} is in both {seen[t.name]} and {s.path.name}"
                )
            seen[t.name] = s.path.name


def _check_fd_unchanged(path: Path, fd: int, size_bytes: int, mtime_ns: int) -> None:
    st = os.fstat(fd)
    if (st.st_size, st.st_mtime_ns) != (size_bytes, mtime_ns):
        raise InvalidCheckpoint(
            f"{path.name}: changed while importing (size or mtime differ); import again "
            "once nothing writes to it"
        )
