"""What ``pool.check`` (:mod:`spswap.daemon.pool_ops`) keeps between calls: the entries
found whole, with their data file as it was then (not read again for a minute unless the
file changed: any user may ask, and a check reads every byte of an entry), and the lock
that keeps checks one at a time."""

from __future__ import annotations

import threading
import time

from spswap.pool.index import FileKey

RECHECK_AFTER_S = 60.0  # damage that leaves the file's times alone (memory, a device)


class PoolChecks:
    """The entries found whole (with their data file as it was then) and the one lock
    that keeps checks one at a time: a check reads every byte of an entry."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._whole: dict[str, tuple[FileKey, float]] = {}  # digest -> (file, when)

    def known_whole(self, digest: str, key: FileKey | None) -> bool:
        """Found whole less than :data:`RECHECK_AFTER_S` ago, its data file unchanged."""
        seen = self._whole.get(digest)
        return key is not None and seen is not None and seen[0] == key and \
            time.monotonic() - seen[1] < RECHECK_AFTER_S  # fmt: skip

    def record(self, digest: str, key: FileKey | None, *, whole: bool) -> None:
        if whole and key is not None:
            self._whole[digest] = (key, time.monotonic())
        else:
            self._whole.pop(digest, None)
