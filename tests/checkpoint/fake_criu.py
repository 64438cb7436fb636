"""A stand-in for root's CRIU, for the one thing root's CRIU cannot do on these machines
(their root lacks CAP_SYS_RESOURCE: "Can't get rlimit"): dump another uid's tree. It does
what CRIU does with credentials and nothing else: at its start (where CRIU seizes) it
reads every task's credentials from /proc, records them in CRIU's format (pstree.img,
core-<tid>.img) and in ``seen.json`` beside the images root, then kills the tree (as a
dump without --leave-running does). ``--version`` answers like CRIU 4.1.1."""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, os.environ["SPSWAP_FAKE_CRIU_PATH"])
from tests.checkpoint import criu_images as ci  # noqa: E402


def status(pid):
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.split() for k, _, v in (line.partition(":") for line in lines)}


def tree(pid):
    out = [pid]
    for tid in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
            out += tree(int(child))
    return out


def main(argv):
    if "--version" in argv:
        print("Version: 4.1.1")
        return 0
    if argv[1] != "dump":
        return 1
    pid = int(argv[argv.index("--tree") + 1])
    images = Path(argv[argv.index("--images-dir") + 1])
    pids = tree(pid)
    seen, entries = {}, []
    for p in pids:
        st = status(p)
        caps = {
            n: (int(st[k][0], 16) & 0xFFFFFFFF, int(st[k][0], 16) >> 32)
            for n, k in ((9, "CapInh"), (10, "CapPrm"), (11, "CapEff"), (19, "CapAmb"))
        }
        uids = list(map(int, st["Uid"]))
        if os.environ.get("SPSWAP_FAKE_CRIU_EUID"):  # a CRIU that recorded a setuid exec
            uids[1] = int(os.environ["SPSWAP_FAKE_CRIU_EUID"])
        entry = ci.creds(
            tuple(uids), tuple(map(int, st["Gid"])), tuple(map(int, st.get("Groups", []))), caps
        )
        (images / f"core-{p}.img").write_bytes(ci.core_img(1, entry))
        entries.append((p, int(st["PPid"][0]), [p]))
        seen[p] = {k: st[k] for k in ("Uid", "Gid", "CapEff", "CapPrm")}
    (images / "pstree.img").write_bytes(ci.pstree_img(entries))
    with open(images.parent / "seen.json", "a") as f:
        f.write(json.dumps(seen) + "\n")
    if "--leave-running" not in argv:
        for p in pids:
            os.kill(p, signal.SIGKILL)
    print("Dumping finished successfully")
    return 0


sys.exit(main(sys.argv))
