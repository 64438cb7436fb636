"""File-system helpers."""


def test_others_can_replace(tmp_path):
    """A private socket's directory: every directory above must be the user's or root's
    and not writable by others unless sticky."""
    import os

    from spswap.fsutil import others_can_replace

    base = tmp_path / "base"
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    assert others_can_replace(base / "job" / "state", 0) is None  # not made yet: fine
    assert others_can_replace(base, 4321) is None  # root-owned, 0755
    os.chmod(base, 0o775)
    assert "writable by group (mode 775)" in others_can_replace(base / "state", 0)
    os.chmod(base, 0o1777)  # sticky, as /tmp: others cannot rename what is not theirs
    assert others_can_replace(base / "state", 0) is None
    os.chmod(base, 0o755)
    mine = base / "mine"
    mine.mkdir()
    os.chown(mine, 4321, -1)
    assert others_can_replace(mine / "state", 4321) is None
    assert others_can_replace(mine / "state", 1234) == f"{mine} belongs to uid 4321"
    link = base / "link"  # judged by where it leads
    link.symlink_to(mine)
    assert others_can_replace(link / "s", 1234) == f"{mine} belongs to uid 4321"
    assert others_can_replace(link / "s", 4321) is None
