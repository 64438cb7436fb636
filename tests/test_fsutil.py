"""File-system helpers."""


def test_others_can_replace(tmp_path):
    """A private socket's directory: every directory above must be the user's or root's
    and not writable by others unless sticky."""
    import os

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to give directories to another uid")

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
    theirs = base / "theirs"  # and by who may re-point it
    theirs.symlink_to(base)
    os.lchown(theirs, 4321, -1)
    why = others_can_replace(theirs / "s", 1234)
    assert why == f"{theirs} is a symbolic link owned by uid 4321"


def test_make_private_dirs_whatever_the_umask(tmp_path):
    """Parts it creates are 0700 even under umask 002, so a later run's check passes (a
    group-writable .spswap made by the first run would refuse every requeued run)."""
    import os
    import stat

    import pytest

    from spswap.errors import PermissionDenied
    from spswap.fsutil import make_private_dirs

    old = os.umask(0o002)
    try:
        target = tmp_path / "work" / ".spswap" / "77"
        make_private_dirs(target, os.getuid())
        for d in (tmp_path / "work", tmp_path / "work" / ".spswap", target):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        make_private_dirs(target, os.getuid())  # the requeued run: still fine
    finally:
        os.umask(old)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o2775)
    with pytest.raises(PermissionDenied, match="not private: .*writable by group.*--state-dir"):
        make_private_dirs(shared / "s", os.getuid())


def test_rename_noreplace_never_replaces(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from spswap.fsutil import rename_noreplace

    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    with pytest.raises(FileExistsError):
        rename_noreplace(str(tmp_path / "a"), str(tmp_path / "b"))
    assert (tmp_path / "a").read_text() == "a" and (tmp_path / "b").read_text() == "b"
    rename_noreplace(str(tmp_path / "a"), str(tmp_path / "c"))
    assert not (tmp_path / "a").exists() and (tmp_path / "c").read_text() == "a"
    with pytest.raises(FileNotFoundError):
        rename_noreplace(str(tmp_path / "a"), str(tmp_path / "d"))
