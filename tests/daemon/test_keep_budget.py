"""Which kept instances the keep budget ends (spswapd's bookkeeping, pure)."""

from spswap.daemon.kept import over_budget


def test_over_budget_ends_the_oldest_first() -> None:
    sizes = [("old", 5), ("mid", 3), ("new", 4)]
    assert over_budget(sizes, 12) == []
    assert over_budget(sizes, 8) == ["old"]
    assert over_budget(sizes, 4) == ["old", "mid"]
    assert over_budget(sizes, 0) == ["old", "mid", "new"]
    assert over_budget([], 0) == []
