"""Every error spswap raises on purpose.

Each message says what happened and what to do next; the CLI prints ``str(err)``
and exits with ``err.exit_code``.
"""

from __future__ import annotations

from collections.abc import Sequence


class SpswapError(Exception):
    """Base of every error spswap raises on purpose."""

    exit_code = 1


class ConfigError(SpswapError):
    """A setting is missing, unknown or out of range."""

    exit_code = 2


class PoolError(SpswapError):
    """A pool operation failed; the pool is left as it was."""


class InvalidCheckpoint(PoolError):
    """The input is not a usable safetensors checkpoint."""


class PoolEntryNotFound(PoolError):
    """No pool entry matches the given name or digest."""


class PoolCorrupt(PoolError):
    """A pool entry's data no longer matches its manifest."""

    def __init__(self, message: str, *, tensor: str | None = None,
                 users: tuple[str, ...] = ()) -> None:  # fmt: skip
        super().__init__(message)
        self.tensor = tensor
        self.users = users  # the live processes and jobs that use the entry, described


class PoolFull(PoolError):
    """The pool cannot make room: every entry that would have to go is in use."""

    def __init__(self, message: str, *, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class PoolEntryInUse(PoolError):
    """The entry is used by a live process or job and cannot be removed."""


class TransferError(SpswapError):
    """Weights could not be copied from the pool into a model."""


class SlotError(SpswapError):
    """A slot reservation could not be made or released."""


class SlotTimeout(SlotError):
    """Waiting for a slot took longer than the timeout."""

    def __init__(self, message: str, *, holders: Sequence[str]) -> None:
        super().__init__(message)
        self.holders = list(holders)


class RequestRejected(SpswapError):
    """The engine refused one generation request (token ids outside the vocabulary, too
    long for the model): that request is answered with this error, the server goes on."""


class RequestIdTaken(SpswapError):
    """A request id was asked before with another prompt (or length): the answer saved
    under it is not this prompt's, so the request is refused rather than answered."""


class RequestAborted(SpswapError):
    """A request was stopped unfinished because the server is stopping (its drain time
    ran out): it stays saved in the spool and the job's next run answers it."""


class BadHttpRequest(SpswapError):
    """A request to spswap's TCP front is not well-formed HTTP/1.x (answered with 400)."""


class StopRequested(SpswapError):
    """A stop signal (preemption, SIGTERM) came while the run was still waiting to start:
    nothing was started; the run ends cleanly and, after USR1, asks for its requeue."""


class IllegalTransition(SpswapError):
    """An instance was asked to move between two states that are not adjacent."""


class EngineError(SpswapError):
    """An engine failed to load, sleep, wake or generate."""


class PathUnusable(SpswapError):
    """A file or directory spswap needs is missing or of the wrong kind."""


class PermissionDenied(SpswapError):
    """The caller may not act on another user's job, reservation or image."""

    exit_code = 3


class DaemonError(SpswapError):
    """The node daemon is unreachable or answered with an error."""


class ProtocolError(DaemonError):
    """A message on the daemon's socket is malformed, too large or of another version."""


class BadRequest(DaemonError):
    """spswapd refused a request's arguments (malformed, incomplete or out of range); the
    message names the argument and what it must be."""


class RequestRefused(DaemonError):
    """spswapd refused a well-formed request: a per-user limit is reached, or the job or
    process it names is not (or no longer) on this node."""


class SlurmCommandError(SpswapError):
    """A Slurm command failed; carries the command and its output."""

    def __init__(self, message: str, *, argv: Sequence[str], output: str = "") -> None:
        super().__init__(message)
        self.argv = list(argv)
        self.output = output


class CheckpointFailed(SpswapError):
    """A CRIU or CUDA checkpoint/restore step failed."""

    def __init__(
        self, message: str, *, log_path: str | None = None, log_tail: Sequence[str] = ()
    ) -> None:
        tail = "\n".join(log_tail)
        full = message if not tail else f"{message}\nlast lines of {log_path}:\n{tail}"
        super().__init__(full)
        self.log_path = log_path
        self.log_tail = list(log_tail)


class ImageRejected(CheckpointFailed):
    """A checkpoint image may not be restored here (identity, integrity, ownership): the
    run starts cold (from the pool) instead."""


class CriuNotStarted(CheckpointFailed):
    """CRIU itself could not be started (its binary, or the cgroup it was to start in):
    nothing was dumped or restored, and the image is as it was."""


class ImageNotFound(SpswapError):
    """No checkpoint image matches the job id or image name given."""


class ImageUnreadable(SpswapError):
    """A checkpoint image's files are missing, cut short or not in CRIU's format: what
    they hold cannot be read (a restore then refuses the image: its credentials cannot
    be checked; `spswap images show` says so)."""
