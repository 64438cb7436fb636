"""Real CRIU on a real process: dump, restore, and every trap the module handles."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from spswap.checkpoint import criu
from spswap.errors import CheckpointFailed

from .criu_helpers import Server, ask, needs_criu

pytestmark = [pytest.mark.criu, needs_criu]


def test_dump_then_restore_continues_the_same_state(server: Server, tmp_path: Path) -> None:
    images = tmp_path / "images"
    token, count, total = server.ask().split()
    assert count == "1"
    info = criu.dump(server.pid, "counter", images)
    assert info.path == images / "counter" and info.path.is_dir()
    assert info.size_bytes > 1 << 20 and info.pid == server.pid
    assert (info.path / "dump.log").read_text().strip().endswith("Dumping finished successfully")
    assert not [p for p in images.iterdir() if p.name.startswith(".tmp-")]
    # The dumped process is gone (our zombie child until restore reaps it).
    assert server.proc.poll() is not None or not criu.proctree.pid_exists(server.pid)

    pid = criu.restore("counter", images)
    assert pid == server.pid
    again_token, again_count, again_total = server.ask().split()
    assert again_token == token  # same memory, not a fresh start
    assert (int(again_count), int(again_total)) == (2, int(total) + 2)
    # Detached: the restored process is not our child.
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_dump_refuses_an_existing_key(server: Server, tmp_path: Path) -> None:
    (tmp_path / "images" / "taken").mkdir(parents=True)
    with pytest.raises(CheckpointFailed, match="exists already"):
        criu.dump(server.pid, "taken", tmp_path / "images")
    assert server.ask().split()[1] == "1"


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_tmpfs_deletes_the_partial_image_and_the_process_runs_on(
    server: Server, tmp_path: Path, tiny_tmpfs: Path
) -> None:
    server.ask()
    logs = tmp_path / "logs"
    with pytest.raises(CheckpointFailed) as exc:
        criu.dump(server.pid, "big", tiny_tmpfs, log_dir=logs)
    err = exc.value
    assert "full" in str(err) and "keeps running" in str(err)
    assert err.log_path == str(logs / "big.dump.log")
    assert "No space left on device" in Path(err.log_path).read_text()
    assert err.log_tail and "last lines of" in str(err) and err.log_tail[-1] in str(err)
    assert list(tiny_tmpfs.iterdir()) == []  # no partial image, no temp dir
    assert server.ask().split()[1] == "2"  # resumed by CRIU, state intact


def test_restore_while_the_pid_is_in_use_fails_clearly(server: Server, tmp_path: Path) -> None:
    images = tmp_path / "images"
    criu.dump(server.pid, "live", images, leave_running=True)
    assert server.ask().split()[1] == "1"  # still running after --leave-running
    with pytest.raises(CheckpointFailed) as exc:
        criu.restore("live", images, pid_wait_s=0.3)
    assert f"pid {server.pid} (python" in str(exc.value) and "still in use" in str(exc.value)
    # Once it is gone (and reaped by restore's wait), the same image restores.
    server.kill()
    pid = criu.restore("live", images, pid_wait_s=5)
    assert pid == server.pid
    assert server.ask().split()[1] == "1"  # the state at the dump, not the later one


def test_restore_failure_carries_the_log_tail(server: Server, tmp_path: Path) -> None:
    images = tmp_path / "images"
    info = criu.dump(server.pid, "broken", images)
    (info.path / "pstree.img").unlink()
    with pytest.raises(CheckpointFailed) as exc:
        criu.restore("broken", images, log_dir=tmp_path / "logs")
    err = exc.value
    assert err.log_path == str(tmp_path / "logs" / "broken.restore.log")
    assert err.log_tail and err.log_tail[-1] in str(err)
    assert "criu restore of" in str(err)


def test_dump_refuses_a_connected_outside_peer(server: Server, tmp_path: Path) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held:
        held.connect(str(server.sock))
        held.sendall(b"hold")
        assert held.recv(64).strip() == b"holding"
        with pytest.raises(CheckpointFailed) as exc:
            criu.dump(server.pid, "sock", tmp_path / "images")
        held.sendall(b"done")
    assert "connected Unix stream socket" in str(exc.value)
    assert "close client connections" in str(exc.value)
    assert not (tmp_path / "images" / "sock").exists()
    assert server.ask().split()[1] == "1"


def test_dump_refuses_an_io_uring(tmp_path: Path) -> None:
    if Path("/proc/sys/kernel/io_uring_disabled").read_text().strip() != "0":
        pytest.skip("io_uring is disabled on this machine: nothing to detect")
    srv = Server(tmp_path, "--io-uring")
    try:
        with pytest.raises(CheckpointFailed) as exc:
            criu.dump(srv.pid, "ring", tmp_path / "images")
        assert "io_uring" in str(exc.value) and "io_uring_disabled=2" in str(exc.value)
        assert srv.ask().split()[1] == "1"
    finally:
        srv.kill()


def test_tcp_connection_to_itself_is_dumped_closed(tmp_path: Path) -> None:
    """A tree connected to itself over TCP (torch.distributed's store in a one-GPU vLLM)
    dumps with --tcp-close and comes back with its memory."""
    import json

    srv = Server(tmp_path, "--tcp-self")
    try:
        first = srv.ask().split()
        info = criu.dump(srv.pid, "tcp", tmp_path / "images")
        assert json.loads((info.path / criu.DUMP_META).read_text())["tcp_close"] is True
        srv.proc.wait(timeout=10)
        pid = criu.restore("tcp", tmp_path / "images")
        after = ask(srv.sock).split()
        assert after[0] == first[0] and after[1] == "2"  # same token, count went on
        srv.kill(pid)
    finally:
        srv.kill()


def test_a_dump_that_leaves_the_tree_running_keeps_it_whole(tmp_path: Path) -> None:
    """--leave-running (spswapd's kept instances): the tree runs on after the dump with
    its memory, its TCP connection to itself still open (--tcp-close closes it only in the
    image) and its linked mapping; the image is the way back once the tree is gone."""
    sem_dir = tmp_path / "shm"
    sem_dir.mkdir()
    srv = Server(tmp_path, "--tcp-self", "--linked-map", str(sem_dir))
    try:
        token, count, _ = srv.ask().split()
        assert srv.ask(b"tcp") == "tcp ping"
        info = criu.dump(srv.pid, "kept", tmp_path / "images", leave_running=True)
        assert srv.proc.poll() is None  # still running, the same process
        after = srv.ask().split()
        assert after[:2] == [token, str(int(count) + 1)]
        assert srv.ask(b"tcp") == "tcp ping"  # the live connection was not touched
        import json

        # CRIU deleted its links at the end of the dump; its action script kept them
        remaps = json.loads((info.path / criu.DUMP_META).read_text())["link_remaps"]
        assert remaps and all((sem_dir / r["parked"]).is_file() for r in remaps)
        assert not list(sem_dir.glob("link_remap.*"))
        srv.kill()
        srv.proc.wait(timeout=10)
        pid = criu.restore("kept", tmp_path / "images")  # the tree as it was dumped
        back = ask(srv.sock).split()
        assert back[:2] == [token, str(int(count) + 1)]
        srv.kill(pid)
        criu.remove_image(info.path)  # the restore took CRIU's names, this the parked ones
        assert [p.name for p in sem_dir.iterdir() if not p.name.startswith("sem.")] == []
    finally:
        srv.kill()


def test_files_linked_under_another_name_are_parked_per_image(tmp_path: Path) -> None:
    """Two trees that map a file by a deleted name while another name links it (a named
    POSIX semaphore: vLLM's server holds several) are dumped one after the other: CRIU's
    link_remap.<id> names can repeat between images, so each image parks its links under
    its own names; both restore onto the same inode (the count lands in the linked file), and
    nothing is left behind."""
    import json

    sems = tmp_path / "shm"
    sems.mkdir()
    images = tmp_path / "images"
    servers = [Server(tmp_path / d, "--linked-map", str(sems)) for d in ("a", "b")
               if (tmp_path / d).mkdir() is None]  # fmt: skip
    try:
        tokens = [s.ask().split()[0] for s in servers]
        for key, srv in zip(("a", "b"), servers, strict=True):
            info = criu.dump(srv.pid, key, images)
            remaps = json.loads((info.path / criu.DUMP_META).read_text())["link_remaps"]
            assert [r["parked"] for r in remaps] == [f".spswap-remap-{key}-{r['name'][11:]}"
                                                     for r in remaps] and remaps  # fmt: skip
            assert not list(sems.glob("link_remap.*"))
            srv.proc.wait(timeout=10)
        for key, srv, token in zip(("a", "b"), servers, tokens, strict=True):
            pid = criu.restore(key, images)
            assert srv.ask().split()[:2] == [token, "2"]
            assert (sems / f"sem.{token}").read_bytes()[:16].strip() == b"2"  # the same inode
            assert not list(sems.glob("link_remap.*"))  # CRIU removed its name again
            criu.remove_image(images / key)
            srv.kill(pid)
        assert sorted(p.name for p in sems.iterdir()) == sorted(f"sem.{t}" for t in tokens)
    finally:
        for srv in servers:
            srv.kill()


def test_an_image_removed_unrestored_takes_its_parked_links(tmp_path: Path) -> None:
    sems = tmp_path / "shm"
    sems.mkdir()
    srv = Server(tmp_path, "--linked-map", str(sems))
    try:
        srv.ask()
        info = criu.dump(srv.pid, "gone", tmp_path / "images")
        assert [p.name for p in sems.iterdir() if p.name.startswith(".spswap-remap-gone-")]
        assert criu.remove_image(info.path) == "gone" and not info.path.exists()
        assert [p.name for p in sems.iterdir()] == [n for n in os.listdir(sems) if
                                                    n.startswith("sem.")]  # fmt: skip
        assert len(os.listdir(sems)) == 1
    finally:
        srv.kill()


def test_a_parked_link_swapped_for_a_symlink_is_not_restored(tmp_path: Path) -> None:
    """The parked link sits in the user's directory: replaced by a symlink to a file of
    someone else, the restore refuses instead of handing that file to CRIU."""
    import json

    sems = tmp_path / "shm"
    sems.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 4096)
    srv = Server(tmp_path, "--linked-map", str(sems))
    try:
        srv.ask()
        info = criu.dump(srv.pid, "swap", tmp_path / "images")
        srv.proc.wait(timeout=10)
        record = json.loads((info.path / criu.DUMP_META).read_text())["link_remaps"][0]
        parked = sems / record["parked"]
        parked.unlink()
        parked.symlink_to(secret)
        with pytest.raises(CheckpointFailed, match="not the file the dump set aside"):
            criu.restore("swap", tmp_path / "images")
        assert not (sems / record["name"]).exists()
        assert not criu.proctree.pid_exists(srv.pid)
    finally:
        srv.kill()


@pytest.mark.parametrize("leave_running", [False, True], ids=["ended", "left-running"])
def test_link_remap_names_planted_by_a_user_are_set_aside_for_the_run(
    tmp_path: Path, leave_running: bool
) -> None:
    """Anyone can make /dev/shm/link_remap.N, the names CRIU needs for a tree holding a
    named semaphore. Planted (here the first 40, a user's), they would fail every dump and
    restore of such trees; spswap moves them aside for each CRIU run and puts them back
    untouched after it."""
    import json

    from spswap.checkpoint import link_remap

    sems = tmp_path / "shm"
    sems.mkdir()
    os.chmod(sems, 0o1777)
    planted = {}
    for n in range(1, 41):
        path = sems / f"link_remap.{n}"
        path.write_text(f"mine {n}")
        os.chown(path, 4242, 4242)
        planted[path.name] = os.stat(path).st_ino
    assert link_remap.names_taken([str(sems), str(tmp_path / "missing")]) == sorted(
        str(sems / name) for name in planted)  # fmt: skip

    def untouched() -> None:
        names = {p.name for p in sems.iterdir()}
        assert not any(n.startswith(link_remap.ASIDE_PREFIX) for n in names), names
        for name, ino in planted.items():
            st = os.stat(sems / name)
            assert (st.st_ino, st.st_uid) == (ino, 4242)
            assert (sems / name).read_text() == f"mine {name.split('.')[1]}"

    srv = Server(tmp_path, "--linked-map", str(sems))
    try:
        token = srv.ask().split()[0]
        info = criu.dump(srv.pid, "planted", tmp_path / "images", leave_running=leave_running)
        meta = json.loads((info.path / criu.DUMP_META).read_text())
        assert meta["link_remaps"] and len(meta["names_set_aside"]) == 40
        assert "names_left_aside" not in meta
        untouched()
        if leave_running:
            srv.kill()
        srv.proc.wait(timeout=10)
        pid = criu.restore("planted", tmp_path / "images")
        assert srv.ask().split()[:2] == [token, "2"]
        untouched()
        srv.kill(pid)
    finally:
        srv.kill()


def test_links_are_kept_by_root_only_in_root_directories(tmp_path: Path) -> None:
    """Where the post-dump step of a kept dump may link as root: /dev/shm, not a user's
    directory, and never through a symlink."""
    from spswap.checkpoint.link_remap import LinkedFile, in_root_dirs

    assert os.geteuid() == 0  # CRIU tests run as root
    assert in_root_dirs([LinkedFile("/dev/shm", 1, 2)])
    user_dir = tmp_path / "u"
    user_dir.mkdir()
    os.chown(user_dir, 4242, 4242)
    assert not in_root_dirs([LinkedFile("/dev/shm", 1, 2), LinkedFile(str(user_dir), 1, 3)])
    swapped = tmp_path / "swap"
    swapped.symlink_to("/dev/shm")
    assert not in_root_dirs([LinkedFile(str(swapped), 1, 4)])
    assert in_root_dirs([])


def _mapping(pid: int, start: int) -> dict[str, str]:
    """/proc/PID/smaps's entry of the mapping that starts at ``start``: its fields."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: START-END ...
            if inside:
                break
            inside = int(head.split("-")[0], 16) == start
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    assert fields, f"no mapping at {start:x} in pid {pid}"
    return fields


def test_a_restore_fills_large_memory_in_huge_pages_only_where_the_node_says(
    tmp_path: Path,
) -> None:
    """SPSWAP_RESTORE_HUGEPAGES: CRIU (with spswap's thp-fill patch) advises huge pages on
    a large region the image fills densely before it fills it, when asked, and not
    otherwise (with THP "madvise", stock CRIU applies the dump's advice only after the
    fill); never on a large sparse region (whose few pages would each become 2 MiB);
    either way the region's bytes come back as they were."""
    from spswap.doctor import criu_patches
    from spswap.doctor_node import THP_ENABLED, THP_FILL_PATCH, thp_mode

    path = criu.find_criu()
    assert path is not None
    if THP_FILL_PATCH not in (criu_patches(path) or ()):
        pytest.skip(f"{path} was not built with spswap's {THP_FILL_PATCH}: run "
                    "scripts/build_criu.sh")  # fmt: skip
    mode = thp_mode(THP_ENABLED.read_text() if THP_ENABLED.exists() else None)
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode or 'not in this kernel'} here")
    for hugepages in (False, True):
        srv = Server(tmp_path, "--anon-mib", "256", "--sparse-mib", "128")
        try:
            before = srv.ask(b"anon")
            dense_at, sparse_at = (int(a, 16) for a in srv.ask(b"where").split())
            key = f"thp-{hugepages}"
            criu.dump(srv.pid, key, tmp_path / "images")
            srv.proc.wait(timeout=10)
            pid = criu.restore(key, tmp_path / "images", hugepages=hugepages)
            dense, sparse = _mapping(pid, dense_at), _mapping(pid, sparse_at)
            assert ask(srv.sock, b"anon") == before  # the bytes, whatever the page size
            # the advice is the patch's doing and certain; how many huge pages the kernel
            # then found is the machine's (at least one: the fill took them)
            assert ("hg" in dense["VmFlags"].split()) is hugepages, dense
            assert "hg" not in sparse["VmFlags"].split(), sparse
            if hugepages:
                assert int(dense["AnonHugePages"].split()[0]) > 0, dense
            srv.kill(pid)
        finally:
            srv.kill()
            (srv.sock).unlink(missing_ok=True)
            Path(str(srv.sock) + ".ready").unlink(missing_ok=True)
