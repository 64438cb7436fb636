"""The image budget's plan (spswapd's bookkeeping, pure) and its limits from settings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spswap.daemon.image_room import (
    DUMP_OVERHEAD_BYTES,
    ImageOnNode,
    ImageRoom,
    Limits,
    images_on_node,
    plan_room,
    reserve_bytes,
)
from spswap.errors import CheckpointFailed

MIB = 1 << 20
ME, OTHER = 1000, 1001


def img(job: str, uid: int | None, mib: int, created: float) -> ImageOnNode:
    return ImageOnNode(job, uid, mib * MIB, created)


LIMITS = Limits(total_bytes=1000 * MIB, user_bytes=300 * MIB, free_bytes=10_000 * MIB,
                reserve_bytes=10 * MIB)  # fmt: skip


def test_a_dump_that_fits_drops_nothing() -> None:
    plan = plan_room([img("1", ME, 100, 1), img("2", OTHER, 500, 2)], uid=ME,
                     need_bytes=200 * MIB, limits=LIMITS)  # fmt: skip
    assert plan == plan_room([], uid=ME, need_bytes=0, limits=LIMITS)
    assert plan.evict == [] and plan.refusal is None


def test_over_the_users_share_the_users_oldest_images_go_first_never_anothers() -> None:
    images = [img("new", ME, 100, 3), img("old", ME, 100, 1), img("theirs", OTHER, 500, 0),
              img("mid", ME, 100, 2)]  # fmt: skip
    plan = plan_room(images, uid=ME, need_bytes=150 * MIB, limits=LIMITS)
    # 300 + 150 > 300: two of mine (oldest first) make 100 + 150 <= 300
    assert [i.job_id for i in plan.evict] == ["old", "mid"] and plan.refusal is None
    assert plan.over == (
        "its image (about 150.0 MiB) and the other images of its user "
        "(300.0 MiB) would be more than SPSWAP_IMAGES_USER_BYTES (300.0 MiB)"
    )


def test_over_the_nodes_budget_the_users_own_images_make_room() -> None:
    images = [img("theirs", OTHER, 800, 0), img("mine", ME, 100, 1)]
    plan = plan_room(images, uid=ME, need_bytes=150 * MIB, limits=LIMITS)
    assert [i.job_id for i in plan.evict] == ["mine"] and plan.refusal is None


def test_what_cannot_fit_is_refused_and_drops_nothing() -> None:
    images = [img("theirs", OTHER, 900, 0), img("mine", ME, 50, 1)]
    plan = plan_room(images, uid=ME, need_bytes=200 * MIB, limits=LIMITS)
    assert plan.evict == []
    assert plan.refusal == (
        "its image (about 200.0 MiB) and the node's other images "
        "(900.0 MiB) would be more than SPSWAP_IMAGES_BYTES (1000.0 MiB)"
    )
    too_big = plan_room([], uid=ME, need_bytes=301 * MIB, limits=LIMITS)
    assert too_big.refusal == ("its image (about 301.0 MiB) and the other images of its user "
                               "(0 B) would be more than SPSWAP_IMAGES_USER_BYTES "
                               "(300.0 MiB)")  # fmt: skip


def test_the_file_systems_free_space_keeps_its_reserve() -> None:
    tight = Limits(total_bytes=1000 * MIB, user_bytes=1000 * MIB, free_bytes=100 * MIB,
                   reserve_bytes=10 * MIB)  # fmt: skip
    assert plan_room([], uid=ME, need_bytes=90 * MIB, limits=tight).refusal is None
    refused = plan_room([], uid=ME, need_bytes=91 * MIB, limits=tight)
    assert refused.refusal == (
        "its image (about 91.0 MiB) would leave less than 10.0 MiB "
        "free on the file system of the images (100.0 MiB free)"
    )
    # dropping the user's own image frees its pages on the file system too
    freed = plan_room([img("mine", ME, 50, 1)], uid=ME, need_bytes=120 * MIB, limits=tight)
    assert [i.job_id for i in freed.evict] == ["mine"] and freed.refusal is None


def test_dumps_under_way_count_and_images_in_use_stay() -> None:
    images = [img("busy", ME, 100, 1), img("idle", ME, 100, 2)]
    plan = plan_room(images, uid=ME, need_bytes=100 * MIB, limits=LIMITS,
                     claimed_bytes=100 * MIB, claimed_user_bytes=100 * MIB,
                     may_drop=lambda i: i.job_id != "busy")  # fmt: skip
    assert [i.job_id for i in plan.evict] == ["idle"] and plan.refusal is None


def test_unset_budgets_are_named_by_their_defaults() -> None:
    limits = Limits(total_bytes=1000 * MIB, user_bytes=500 * MIB, free_bytes=None,
                    reserve_bytes=0, total_set=False, user_set=False)  # fmt: skip
    refusal = plan_room([], uid=ME, need_bytes=600 * MIB, limits=limits).refusal
    assert refusal is not None and refusal.endswith(
        "would be more than one user's share (SPSWAP_IMAGES_USER_BYTES unset: half of "
        "the images' budget) (500.0 MiB)")  # fmt: skip


def test_reserve_is_five_percent_up_to_512_mib() -> None:
    assert reserve_bytes(100 * MIB) == 5 * MIB
    assert reserve_bytes(1 << 40) == 512 * MIB


def _image(root: Path, job: str, uid: int, size: int, created: float) -> None:
    d = root / f"job{job}-model-config-ident"
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(b"x" * size)
    (d / "meta.json").write_text(json.dumps({"identity": {"uid": uid}, "created_at": created}))


def test_images_on_node_reads_each_images_user_size_and_age(tmp_path: Path) -> None:
    _image(tmp_path, "7", ME, 1000, 5.0)
    (tmp_path / ".tmp-job8-model-config-ident").mkdir()  # a dump under way: claimed instead
    found = images_on_node(tmp_path)
    assert len(found) == 1 and found[0].job_id == "7" and found[0].uid == ME
    assert found[0].created_s == 5.0 and found[0].size_bytes > 1000  # (with its meta)


def test_make_room_claims_until_released_and_drops_what_the_plan_names(tmp_path: Path) -> None:
    _image(tmp_path, "7", ME, 60 * MIB, 1.0)
    room = ImageRoom(tmp_path, tmp_path / "statuses", total_bytes=None,
                     user_bytes=100 * MIB)  # fmt: skip
    dropped: list[list[str]] = []

    def drop(images: list[ImageOnNode], over: str) -> None:
        assert "would be more than SPSWAP_IMAGES_USER_BYTES (100.0 MiB)" in over
        dropped.append([i.job_id for i in images])
        for i in images:
            for d in tmp_path.glob(f"job{i.job_id}-*"):
                for f in d.iterdir():
                    f.unlink()
                d.rmdir()

    room.make_room("8", ME, 30 * MIB, drop=drop, may_drop=lambda _: True)
    assert dropped == [["7"]] and room.claimed_bytes() == 30 * MIB + DUMP_OVERHEAD_BYTES
    # a second dump of the same user while the first is under way: its claim counts
    with pytest.raises(CheckpointFailed, match="no room for job 9's image: its image"):
        room.make_room("9", ME, 60 * MIB, drop=drop, may_drop=lambda _: True)
    room.release("8")
    room.make_room("9", ME, 60 * MIB, drop=drop, may_drop=lambda _: True)
    assert room.claimed_bytes() == 60 * MIB + DUMP_OVERHEAD_BYTES


def test_default_budgets_come_from_the_file_systems_size(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    limits = ImageRoom(tmp_path, tmp_path, total_bytes=None, user_bytes=None).limits()
    assert limits.total_bytes == st.f_blocks * st.f_frsize // 2
    assert limits.user_bytes == limits.total_bytes // 2
    assert not limits.total_set and not limits.user_set
    set_ = ImageRoom(tmp_path, tmp_path, total_bytes=10 * MIB, user_bytes=None).limits()
    assert (set_.total_bytes, set_.user_bytes, set_.total_set) == (10 * MIB, 5 * MIB, True)
