"""The image restored early (spswap.daemon.prerestore): when memory allows it (and
restores at once), the held
cgroups' lifetime, MemAvailable read. The restore itself, with the real CRIU and a real
spswapd: tests/checkpoint/test_faults.py (the no-keep and keep-budget cases)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spswap.daemon.kept import HeldCgroups
from spswap.daemon.memory_claims import (
    MEMORY_MARGIN_BYTES,
    MemoryClaims,
    mem_available_bytes,
    refusal,
)

GIB = 1 << 30


def test_refusal_needs_memory_for_the_tree_beside_its_image() -> None:
    assert refusal(image_bytes=3 * GIB, available_bytes=3 * GIB + MEMORY_MARGIN_BYTES) is None
    assert refusal(image_bytes=3 * GIB, available_bytes=4 * GIB) == (
        "not enough free memory for the tree beside its image (5120 MiB needed, 4096 MiB available)"
    )
    assert refusal(image_bytes=1, available_bytes=None) == "the free memory is not known"


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   1048576 kB\n")
    assert mem_available_bytes(meminfo) == GIB
    meminfo.write_text("MemTotal:       32000000 kB\n")
    assert mem_available_bytes(meminfo) is None
    assert mem_available_bytes(tmp_path / "none") is None
    assert (mem_available_bytes() or 0) > 0  # this machine's


def test_restores_at_once_do_not_count_the_same_free_memory_twice() -> None:
    """Two prologs at once: the second early restore is judged on the memory the first
    one has not yet taken; a refused claim holds nothing, an ended one gives it back."""
    available = [10 * GIB]
    claims = MemoryClaims(lambda: available[0])
    with claims.claim(5 * GIB) as first:
        assert first is None and claims.claimed_bytes == 5 * GIB
        with claims.claim(4 * GIB) as second:
            assert second == ("not enough free memory for the tree beside its image "
                              "(6144 MiB needed, 5120 MiB available)")  # fmt: skip
            assert claims.claimed_bytes == 5 * GIB
        with claims.claim(3 * GIB) as third:
            assert third is None and claims.claimed_bytes == 8 * GIB
    assert claims.claimed_bytes == 0
    available[0] = 4 * GIB
    with claims.claim(2 * GIB) as fits:
        assert fits is None
        available[0] = GIB  # memory went elsewhere meanwhile: less than is claimed
        with claims.claim(1) as over:
            assert over is not None and "0 MiB available" in over
    assert claims.claimed_bytes == 0
    assert MemoryClaims(lambda: None).claim(1).__enter__() == "the free memory is not known"
    # the look before an image's check claims nothing
    available[0] = 10 * GIB
    with claims.claim(5 * GIB):
        assert claims.short(4 * GIB) is not None and claims.short(GIB) is None
        assert claims.claimed_bytes == 5 * GIB


class Parking:
    def __init__(self, removed: list[str], name: str) -> None:
        self.removed, self.name = removed, name

    def remove(self) -> None:
        self.removed.append(self.name)


def test_held_cgroups_one_per_job_removed_when_replaced_or_dropped() -> None:
    removed: list[str] = []
    held = HeldCgroups()
    held.hold("7", Parking(removed, "a"))
    held.hold("7", Parking(removed, "b"))  # the job dumped again: the older one goes
    assert removed == ["a"] and held.has("7")
    taken = held.take("7")
    assert taken is not None and taken.name == "b" and not held.has("7")
    assert held.take("7") is None
    held.hold("8", Parking(removed, "c"))
    held.drop("8")
    held.drop("9")  # none: nothing happens
    assert removed == ["a", "c"] and not held.has("8")


def test_why_a_parked_tree_is_not_kept_alive_is_said_in_the_settings_words() -> None:
    from spswap.daemon.ckpt_dump import _not_kept_because

    assert _not_kept_because(0, 5, set_bytes=0) == (
        "SPSWAP_KEEP_BYTES is 0: no instance is kept alive on this node"
    )
    assert _not_kept_because(0, 5, set_bytes=None) == (
        "the keep budget is 0 (SPSWAP_KEEP_BYTES unset and the node's memory unknown)"
    )
    assert _not_kept_because(1, 3 * GIB, set_bytes=1) == (
        "it holds 3.0 GiB of memory, more than SPSWAP_KEEP_BYTES (1 B) keeps alive"
    )
    assert _not_kept_because(2 * GIB, 3 * GIB, set_bytes=None) == (
        "it holds 3.0 GiB of memory, more than the keep budget (SPSWAP_KEEP_BYTES unset: "
        "1/8 of the node's memory, 2.0 GiB) keeps alive"
    )
    assert _not_kept_because(8 * GIB, 3 * GIB, set_bytes=None) is None


def test_the_early_restore_asks_criu_for_huge_pages_as_the_node_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPSWAP_RESTORE_HUGEPAGES reaches CRIU's restore at the prolog (the real fill:
    tests/checkpoint/test_criu_real.py); CRIU stood in for, as it cannot start here."""
    from spswap.config import Config
    from spswap.daemon import prerestore
    from spswap.errors import CriuNotStarted

    asked: list[bool] = []

    def restore(*_args: Any, hugepages: bool = False, **_kw: Any) -> int:
        asked.append(hugepages)
        raise CriuNotStarted("stood in for")

    monkeypatch.setattr(prerestore.criu, "restore", restore)
    parking = SimpleNamespace(dirs={}, freeze=lambda: True)
    for setting in ("0", "1"):
        cfg = Config.from_env({"SPSWAP_RESTORE_HUGEPAGES": setting}, root=tmp_path)
        with pytest.raises(CriuNotStarted):
            prerestore._restore_into(SimpleNamespace(cfg=cfg), "7", 0, tmp_path, parking, 0.0)
    assert asked == [False, True]
