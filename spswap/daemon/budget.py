"""How many of the daemon's descriptors and threads each user may hold at once.

Every connection holds a socket (and a thread), and descriptors passed with a request
(SCM_RIGHTS) sit in the daemon's table until the request's line is complete. Without a
total per user, one user's idle connections, each with its descriptors passed, filled
the daemon's table (1024 at systemd's default soft limit): ``accept`` then failed with
EMFILE and every other user's request with it. So each user (root excepted: the prolog
and epilog must always get through) may hold a share of the descriptors, and all users
together leave a reserve for the daemon's own files (pool writes, CRIU, logs).
"""

from __future__ import annotations

import resource
import threading

MAX_CONNECTIONS_PER_UID = 64
"""One user's connections at once (each holds a thread; a reservation waiting in line holds
its connection): enough for the jobs of a full node, not for a flood that would leave
other users' prologs and jobs without the daemon."""
MAX_FDS_PER_UID = 2048
"""One user's connections plus the descriptors passed on them, at most (fewer when the
daemon's own limit is low: see :func:`fd_share`)."""
MIN_FDS_PER_UID = 16
USER_SHARES = 8
"""The users that may each hold a full share before the reserve is reached."""


FD_LIMIT_WANTED = 65536
"""What :func:`raise_fd_limit` raises the soft limit to, at most (as the unit's LimitNOFILE):
a soft limit of a billion (some containers' hard one) slows every child that closes its
descriptors one by one."""


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit towards the hard one (systemd's soft default of
    1024 is meant for select() users, not a daemon serving every job of a node), to at
    most :data:`FD_LIMIT_WANTED`; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT_WANTED if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT_WANTED)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def fd_share(limit: int) -> tuple[int, int]:
    """``(per uid, all users together)`` for a daemon allowed ``limit`` descriptors: an
    eighth stays the daemon's own; the rest is shared, each user at most an eighth."""
    users = limit - max(64, limit // USER_SHARES)
    per_uid = max(MIN_FDS_PER_UID, min(MAX_FDS_PER_UID, users // USER_SHARES))
    return per_uid, max(users, per_uid)


class Budget:
    """Counts, per uid, connections and descriptors held; thread-safe."""

    def __init__(self, limit: int | None = None) -> None:
        if limit is None:
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.per_uid, self.all_users = fd_share(limit)
        self._conns: dict[int, int] = {}
        self._fds: dict[int, int] = {}  # connections + passed descriptors + grants
        self._users_total = 0
        self._lock = threading.Lock()

    def admit(self, uid: int) -> str | None:
        """Count a new connection of ``uid``; why not (None: admitted)."""
        with self._lock:
            if uid != 0:
                if self._conns.get(uid, 0) >= MAX_CONNECTIONS_PER_UID:
                    return (
                        f"uid {uid} has {MAX_CONNECTIONS_PER_UID} connections to spswapd "
                        "open already; close some (or wait for them to end) and try again"
                    )
                if why := self._over(uid, 1):
                    return why
                self._fds[uid] = self._fds.get(uid, 0) + 1
                self._users_total += 1
            self._conns[uid] = self._conns.get(uid, 0) + 1
            return None

    def leave(self, uid: int) -> None:
        with self._lock:
            self._conns[uid] -= 1
            if not self._conns[uid]:
                del self._conns[uid]
            if uid != 0:
                self._release(uid, 1)

    def grant(self, uid: int, want: int) -> int:
        """Room for up to ``want`` more descriptors of ``uid``, held until :meth:`give`
        hands back what was not (or no longer is) used."""
        with self._lock:
            if uid == 0:
                return want
            room = min(self.per_uid - self._fds.get(uid, 0),
                       self.all_users - self._users_total)  # fmt: skip
            n = max(0, min(want, room))
            self._fds[uid] = self._fds.get(uid, 0) + n
            self._users_total += n
            return n

    def give(self, uid: int, n: int) -> None:
        if uid == 0 or n <= 0:
            return
        with self._lock:
            self._release(uid, n)

    def held(self, uid: int) -> int:
        """Connections and descriptors ``uid`` holds now (root's are not counted)."""
        with self._lock:
            return self._fds.get(uid, 0)

    def over_message(self, uid: int) -> str:
        """What a client over its share is told."""
        return (
            f"uid {uid} is at its share of spswapd's descriptors (at most {self.per_uid} "
            "per user: connections, and files passed with requests not yet complete), so "
            "this request was not read; end or close your other connections to spswapd "
            "and try again"
        )

    def _over(self, uid: int, n: int) -> str | None:
        if self._fds.get(uid, 0) + n > self.per_uid:
            return self.over_message(uid)
        if self._users_total + n > self.all_users:
            return (
                "spswapd holds all the descriptors it lets users hold "
                f"({self.all_users}); try again in a moment, or ask the node's admin to "
                "raise LimitNOFILE= in spswapd.service"
            )
        return None

    def _release(self, uid: int, n: int) -> None:
        self._fds[uid] -= n
        self._users_total -= n
        if self._fds[uid] <= 0:
            del self._fds[uid]
