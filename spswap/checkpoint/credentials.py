"""Who a dumped tree's processes are: checked on the live tree, again on the tree frozen
right before CRIU seizes it, and in the image CRIU wrote (a restore gives back exactly
the credentials the image recorded, so a setuid or setgid program, or one with file
capabilities, in the tree would come back with its owner's rights)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from spswap.checkpoint import criu, freeze_hold, proctree
from spswap.errors import CheckpointFailed


def user_groups(uid: int) -> set[int] | None:
    """The groups ``uid`` belongs to (primary and supplementary), or None when the user
    database does not know it (then only the one-gid rule holds)."""
    import pwd

    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return None
    return set(os.getgrouplist(pw.pw_name, pw.pw_gid))


def credentials_problem(pids: list[int], uid: int, proc: Path = Path("/proc")) -> str | None:
    """Why the tree may not be dumped for ``uid``: CRIU restores the credentials the
    processes had, so every one of them must be that user's, with no capabilities and
    one group (a setuid or setgid program in the tree would come back with its owner's
    rights). None when all is well."""
    for pid in pids:
        try:
            lines = (proc / str(pid) / "status").read_text().splitlines()
        except OSError:
            continue  # gone: CRIU will not see it either
        fields = {k: v.split() for k, _, v in (line.partition(":") for line in lines)}
        uids = {int(x) for x in fields.get("Uid", [])}
        if uids != {uid}:
            return f"process {pid} runs with uids {sorted(uids)}, not only {uid}"
        gids = {int(x) for x in fields.get("Gid", [])}
        if uid != 0 and len(gids) > 1:  # a setgid program: it would come back with that group
            return f"process {pid} runs with several gids {sorted(gids)} (a setgid program)"
        allowed = user_groups(uid)
        if uid != 0 and allowed is not None and not gids <= allowed:
            return (f"process {pid} runs with gid {sorted(gids - allowed)}, not a group of uid "
                    f"{uid} (a setgid program)")  # fmt: skip
        if uid != 0 and int(fields.get("CapEff", ["0"])[0], 16) != 0:
            return f"process {pid} holds capabilities (CapEff {fields['CapEff'][0]})"
    return None


def dump_frozen(pid: int, key: str, images_root: Path, uid: int, *, criu_path: Path | None,
                 keep: bool, writes: list[tuple[Path, str]] | None, run_as: criu.RunAs | None,
                 freeze_tag: str, timings: dict[str, float] | None = None,
                 ) -> criu.ImageInfo:  # fmt: skip
    """CRIU's dump of the tree frozen since its last credential check (see
    :mod:`freeze_hold`), the image's own credentials checked before it gets its name
    (:mod:`image_creds`). ``timings`` gets the hold's making and release, and the whole
    dump's seconds (``freeze_hold``, ``hold_release``, ``dump_total``)."""
    t0 = time.monotonic()
    hold = freeze_hold.FreezeHold.create(pid, freeze_tag)
    spent = timings if timings is not None else {}
    spent["freeze_hold"] = time.monotonic() - t0
    try:
        problem = credentials_problem(sorted(hold.pids()) if hold else
                                      proctree.process_tree_pids(pid), uid)  # fmt: skip
        if problem:
            raise CheckpointFailed(f"not dumped: {problem}; a checkpoint restores "
                                   "credentials, so only processes of the job's own user "
                                   "are dumped")  # fmt: skip
        freeze = hold.for_criu((run_as.uid, run_as.gid) if run_as else None) if hold else None
        return criu.dump(pid, key, images_root, criu=criu_path, leave_running=keep,
                         post_dump_writes=writes if keep else None, run_as=run_as,
                         freeze_cgroup=freeze, owner=(uid, user_groups(uid)))  # fmt: skip
    finally:
        t1 = time.monotonic()
        if hold is not None:
            hold.release()
        spent["hold_release"] = time.monotonic() - t1
        spent["dump_total"] = time.monotonic() - t0
