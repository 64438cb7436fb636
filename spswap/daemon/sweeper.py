"""spswapd's periodic sweep: the images and kept instances of jobs that will not come
back are freed within ``Config.sweep_interval_s``.

The epilog tells the daemon when a job ends on this node, and each prolog looks again at
the jobs that left images behind; but a job cancelled while it waits in the queue
(requeued, held, or pending after a preemption) runs neither here, and its image or kept
tree would hold the node's memory until the next job starts. The sweep asks Slurm the
same question the prolog does (:func:`spswap.daemon.job_ops.collect_images`). It also
removes the daemon's own freeze holds left empty (:func:`freeze_hold.sweep_empty_holds`).
"""

from __future__ import annotations

import threading

from spswap.checkpoint.cgroups import root_tag
from spswap.checkpoint.freeze_hold import sweep_empty_holds
from spswap.daemon.job_ops import collect_images
from spswap.daemon.state import DaemonState


class Sweeper:
    """A daemon thread that collects every ``interval_s`` until :meth:`stop`."""

    def __init__(self, st: DaemonState, interval_s: float) -> None:
        self.st = st
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spswap-sweep", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sweep_once(self) -> list[str]:
        """One sweep; the job ids whose images and kept trees went. Never raises: a
        failed sweep is an event, and the next one tries again."""
        # (never raises: its own trouble does not keep the images' collection from running)
        if holds := sweep_empty_holds(root_tag(self.st.cfg.root)):
            self.st.event_quietly("checkpoint.holds_swept", cgroups=holds)
        try:
            return collect_images(self.st, current_job="")
        except Exception as e:  # noqa: BLE001 - the daemon serves on whatever a sweep hits
            self.st.event("sweep.failed", reason=f"{type(e).__name__}: {e}"[:500])
            return []

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sweep_once()
