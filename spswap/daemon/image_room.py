"""Room for checkpoint images on the node's tmpfs.

Images hold host memory (a tmpfs keeps its pages in RAM) for as long as their jobs wait
in the queue. Without a bound, one user's many preempted jobs, or many users' jobs at once,
would fill the file system the pool, the slot table and the event log live on, and take
the memory the running jobs need. So a dump is judged, after its CUDA checkpoint moved the
tree's GPU state into host memory and before CRIU writes anything, on three limits:

- ``SPSWAP_IMAGES_BYTES``: all images of the node together (default: half the file
  system under ``SPSWAP_ROOT``);
- ``SPSWAP_IMAGES_USER_BYTES``: one user's images together (default: half of the above),
  so no user takes the room of the others;
- the file system's free space, less a reserve that keeps spswap's own small files
  writable.

Where the user's own older images stand in the way, the oldest of them go first (their
jobs' next runs start from the pool); another user's image is never dropped for a dump.
Where that is not enough, the dump is refused with the reason and nothing is dropped.
Dumps under way claim their estimate here until their image is on disk.

The plan is pure bookkeeping (no torch, CUDA or Slurm), tested on CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spswap.checkpoint.images import read_meta
from spswap.checkpoint.service import image_job_ids, images_of_job
from spswap.config import Config
from spswap.errors import CheckpointFailed
from spswap.fsutil import dir_size_bytes, fs_sizes
from spswap.units import fmt_bytes

RESERVE_BYTES_MAX = 512 << 20  # left free on the file system after an image
DUMP_OVERHEAD_BYTES = 16 << 20  # CRIU's own records beside the tree's pages


def reserve_bytes(fs_bytes: int) -> int:
    """What a dump must leave free on a file system of ``fs_bytes``: 5%, at most 512 MiB."""
    return min(RESERVE_BYTES_MAX, fs_bytes // 20)


@dataclass(frozen=True)
class ImageOnNode:
    """A finished image, as the budget sees it."""

    job_id: str
    uid: int | None  # from its meta; None where that cannot be read
    size_bytes: int
    created_s: float


@dataclass(frozen=True)
class Limits:
    """The bounds a dump is judged on (bytes); ``free_bytes`` None where unknown;
    ``*_set``: whether the setting was given (else its default applies)."""

    total_bytes: int
    user_bytes: int
    free_bytes: int | None
    reserve_bytes: int
    total_set: bool = True
    user_set: bool = True


@dataclass(frozen=True)
class RoomPlan:
    """The user's images to drop first (oldest first) and why they must go (``over``:
    the limit the dump was over before), or why the dump is refused."""

    evict: list[ImageOnNode]
    refusal: str | None
    over: str | None = None


def _names(limits: Limits) -> tuple[str, str]:
    """How the refusal names the two budgets: the setting, or its default."""
    user = (
        "SPSWAP_IMAGES_USER_BYTES"
        if limits.user_set
        else "one user's share (SPSWAP_IMAGES_USER_BYTES unset: half of the images' budget)"
    )
    total = (
        "SPSWAP_IMAGES_BYTES"
        if limits.total_set
        else "the images' budget (SPSWAP_IMAGES_BYTES unset: half of the file system's size)"
    )
    return f"{user} ({fmt_bytes(limits.user_bytes)})", f"{total} ({fmt_bytes(limits.total_bytes)})"


def plan_room(images: list[ImageOnNode], *, uid: int, need_bytes: int, limits: Limits,
              claimed_bytes: int = 0, claimed_user_bytes: int = 0,
              may_drop: Callable[[ImageOnNode], bool] = lambda _: True) -> RoomPlan:  # fmt: skip
    """Whether an image of ``need_bytes`` by ``uid`` fits beside ``images`` (the job's own
    older image excluded: its dump replaces it) and the dumps under way (``claimed_*``);
    which of the user's own images (those ``may_drop`` allows) to drop, oldest first, to
    make it fit. Drops nothing when even all of them would not make room. Pure."""
    user = claimed_user_bytes + sum(i.size_bytes for i in images if i.uid == uid)
    total = claimed_bytes + sum(i.size_bytes for i in images)
    free = limits.free_bytes
    user_name, total_name = _names(limits)
    need = f"its image (about {fmt_bytes(need_bytes)})"

    def why_not(user_b: int, total_b: int, free_b: int | None) -> str | None:
        if free_b is not None and free_b - need_bytes < limits.reserve_bytes:
            return (
                f"{need} would leave less than {fmt_bytes(limits.reserve_bytes)} free on "
                f"the file system of the images ({fmt_bytes(max(free_b, 0))} free)"
            )
        if user_b + need_bytes > limits.user_bytes:
            return (
                f"{need} and the other images of its user ({fmt_bytes(user_b)}) would "
                f"be more than {user_name}"
            )
        if total_b + need_bytes > limits.total_bytes:
            return (
                f"{need} and the node's other images ({fmt_bytes(total_b)}) would be "
                f"more than {total_name}"
            )
        return None

    over = refusal = why_not(user, total, free)
    evict: list[ImageOnNode] = []
    droppable = sorted((i for i in images if i.uid == uid and may_drop(i)),
                       key=lambda i: i.created_s)  # fmt: skip
    for image in droppable:
        if refusal is None:
            break
        evict.append(image)
        user, total = user - image.size_bytes, total - image.size_bytes
        free = None if free is None else free + image.size_bytes
        refusal = why_not(user, total, free)
    return RoomPlan([] if refusal else evict, refusal, over if evict and not refusal else None)


def images_on_node(images_root: Path, statuses_dir: Path | None = None) -> list[ImageOnNode]:
    """The finished images under ``images_root`` (unfinished dumps and images being
    deleted are not: dumps under way are claimed instead)."""
    out = []
    for job_id in image_job_ids(images_root, statuses_dir):
        for path in images_of_job(images_root, job_id):
            meta = read_meta(path) or {}
            uid = (meta.get("identity") or {}).get("uid")
            out.append(ImageOnNode(job_id, uid if isinstance(uid, int) else None,
                                   dir_size_bytes(path),
                                   float(meta.get("created_at") or 0.0)))  # fmt: skip
    return out


class ImageRoom:
    """The node's image budget (spswapd's; thread-safe: dumps run in threads of their
    own). :meth:`make_room` judges a dump and claims its estimate until :meth:`release`."""

    def __init__(self, images_root: Path, statuses_dir: Path, *,
                 total_bytes: int | None, user_bytes: int | None) -> None:  # fmt: skip
        self.images_root, self.statuses_dir = images_root, statuses_dir
        self._total_set, self._user_set = total_bytes, user_bytes
        self._lock = threading.Lock()
        self._claims: dict[str, tuple[int, int]] = {}  # job -> (uid, bytes)

    @classmethod
    def from_config(cls, cfg: Config) -> ImageRoom:
        """The node's budget as ``cfg`` sets it (spswapd's, and what status shows)."""
        return cls(cfg.paths.images, cfg.paths.run / "checkpoints",
                   total_bytes=cfg.images_bytes, user_bytes=cfg.images_user_bytes)  # fmt: skip

    def limits(self) -> Limits:
        """The limits now: the settings, or their defaults from the file system's size."""
        fs_bytes: int | None
        free: int | None
        try:
            fs_bytes, free = fs_sizes(self.images_root)  # (not made yet: its parent's)
        except OSError:
            fs_bytes = free = None
        total = self._total_set
        if total is None:
            total = fs_bytes // 2 if fs_bytes else 1 << 62  # unknown size: the free check
        user = self._user_set if self._user_set is not None else total // 2
        return Limits(total, user, free, reserve_bytes(fs_bytes) if fs_bytes else 0,
                      total_set=self._total_set is not None,
                      user_set=self._user_set is not None)  # fmt: skip

    def make_room(self, job_id: str, uid: int, need_bytes: int,
                  drop: Callable[[list[ImageOnNode], str], None],
                  may_drop: Callable[[ImageOnNode], bool]) -> None:  # fmt: skip
        """Claim room for job ``job_id``'s image of about ``need_bytes``, having ``drop``
        the user's older images the plan names (with why: the limit it was over); raise
        :class:`CheckpointFailed` (nothing dropped, nothing claimed) when it does not fit."""
        need_bytes += DUMP_OVERHEAD_BYTES
        with self._lock:  # judged and claimed at once: dumps run side by side
            images = [i for i in images_on_node(self.images_root, self.statuses_dir)
                      if i.job_id != job_id]  # fmt: skip
            claims = [c for j, c in self._claims.items() if j != job_id]
            plan = plan_room(images, uid=uid, need_bytes=need_bytes, limits=self.limits(),
                             claimed_bytes=sum(b for _, b in claims),
                             claimed_user_bytes=sum(b for u, b in claims if u == uid),
                             may_drop=may_drop)  # fmt: skip
            if plan.refusal is not None:
                raise CheckpointFailed(
                    f"no room for job {job_id}'s image: {plan.refusal}; its next run starts "
                    "from the pool (the node's admin sets these limits in "
                    "/etc/default/spswap; `spswap status` shows what images hold)"
                )
            self._claims[job_id] = (uid, need_bytes)
        if plan.evict:
            drop(plan.evict, plan.over or "")

    def release(self, job_id: str) -> None:
        """The job's dump ended: its image (if any) is on disk and counts from there."""
        with self._lock:
            self._claims.pop(job_id, None)

    def claimed_bytes(self) -> int:
        with self._lock:
            return sum(b for _, b in self._claims.values())
