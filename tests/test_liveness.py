import os
import subprocess
import sys

from spswap.liveness import Holder, holder_alive, pid_alive, pid_start_time


def test_own_process_is_alive_and_start_time_pins_it():
    me = os.getpid()
    start = pid_start_time(me)
    assert start is not None
    assert pid_alive(me) and pid_alive(me, start)
    assert not pid_alive(me, start + 1)  # same pid, other start: a reused pid


def test_dead_and_zombie_processes_are_not_alive():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    while pid_start_time(p.pid) is not None:  # becomes a zombie until reaped
        if p.poll() is not None:
            break
    assert not pid_alive(p.pid)
    p.wait()
    assert not pid_alive(p.pid)
    assert not pid_alive(0) and not pid_alive(-5)


def test_job_bound_holder_follows_the_job_and_falls_back_to_the_pid():
    dead = Holder(pid=2**22 + 7, pid_start=None, uid=0, job_id="42")
    assert holder_alive(dead, job_alive=lambda j: True)
    assert not holder_alive(dead, job_alive=lambda j: False)
    assert not holder_alive(dead, job_alive=lambda j: None)  # can't tell: the pid decides
    live = Holder.current(job_id="42")
    assert holder_alive(live, job_alive=lambda j: None)
    assert holder_alive(live, job_alive=lambda j: False)  # never reclaim a live process
    assert Holder.from_json(live.to_json()) == live
    assert "job 42" in live.describe()


def test_spswapds_own_image_uses_say_what_they_are_for() -> None:
    from spswap.liveness import Holder

    image = Holder(pid=42, pid_start=7, uid=0, purpose="image", for_job="1086")
    assert image.describe() == ("spswapd, for job 1086's checkpoint image (until that job "
                                "runs again, or ends)")  # fmt: skip
    assert Holder.from_json(image.to_json()) == image
    assert "for_job" not in Holder(pid=1, pid_start=None, uid=0).to_json()
    assert Holder(pid=5, pid_start=None, uid=0, job_id="7").describe() == (
        "job 7 of root, asked by pid 5")  # fmt: skip
    assert Holder(pid=5, pid_start=None, uid=3_999_999_999).describe() == (
        "pid 5 of uid 3999999999")  # fmt: skip
    assert Holder.from_json({"pid": 5, "uid": 1}).purpose is None  # written before the field
    # in a table cell, a few words (the pool table says under it what an image's use is)
    assert image.brief() == "job 1086's image"
    # a name where the node knows the uid, else the uid
    assert Holder(pid=5, pid_start=None, uid=0, job_id="7").brief() == "job 7 (root)"
    assert Holder(pid=5, pid_start=None, uid=0).brief() == "pid 5 (root)"
    unknown = 3_999_999_999
    assert (
        Holder(pid=5, pid_start=None, uid=unknown, job_id="7").brief() == f"job 7 (uid {unknown})"
    )
    assert Holder(pid=5, pid_start=None, uid=unknown).brief() == f"pid 5 (uid {unknown})"


def test_the_pool_table_says_what_an_images_use_is_under_it() -> None:
    from rich.console import Console

    from spswap.liveness import IMAGE_USE_NOTE, Holder
    from spswap.status import render_pool

    def shown(users: list[Holder]) -> str:
        pool = {"used_bytes": 1, "capacity_bytes": 2, "entries": [{
            "name": "m", "digest": "ab" * 32, "size_bytes": 1, "tensor_count": 1,
            "users": [h.to_json() for h in users], "last_used": 0.0}]}  # fmt: skip
        console = Console(width=80, record=True, file=open(os.devnull, "w"))
        console.print(render_pool(pool, 0.0))
        return " ".join(console.export_text().split())  # (folded at 80 columns)

    image = Holder(pid=42, pid_start=7, uid=0, purpose="image", for_job="1086")
    text = shown([image])
    assert "│ job 1086's │" in text and text.endswith(IMAGE_USE_NOTE), text
    assert "kept" in text and "in use now" not in text  # (its job is not running)
    running = shown([image, Holder(pid=5, pid_start=None, uid=1, job_id="7")])
    assert "in use now" in running and "kept for" not in running, running
    assert IMAGE_USE_NOTE not in shown([Holder(pid=5, pid_start=None, uid=1, job_id="7")])
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(render_pool({"used_bytes": 0, "capacity_bytes": 2, "entries": []}, 0.0))
    assert "no entries yet" in console.export_text()  # a sentence, not an empty table
