"""The job's own view of Slurm, read from environment variables, as data.

The same job is seen from three places with different variables: the batch job
(``SLURM_RESTART_COUNT``, unset on the first run), and the Prolog/Epilog run by
slurmd as root (``SLURM_JOB_RESTART_COUNT``, 0 on the first run; ``SLURM_JOB_COMMENT``).
:data:`ENV_VARS` maps each property to the variables that carry it, first match wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_VARS: dict[str, tuple[str, ...]] = {
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "restart_count": ("SLURM_RESTART_COUNT", "SLURM_JOB_RESTART_COUNT"),
    "gpus": ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"),
    "uid": ("SLURM_JOB_UID",),
    "user": ("SLURM_JOB_USER",),
    "comment": ("SLURM_JOB_COMMENT",),
    "node": ("SLURMD_NODENAME",),
    "partition": ("SLURM_JOB_PARTITION",),
    "shards": ("SLURM_SHARDS_ON_NODE",),
}
"""Property -> the variables that carry it, in the order they are looked up."""


def _first(env: Mapping[str, str], prop: str) -> str | None:
    for name in ENV_VARS[prop]:
        value = env.get(name)
        if value is not None and value != "":
            return value
    return None


def parse_gpu_list(text: str | None) -> tuple[int, ...]:
    """``"0,2"`` -> ``(0, 2)``. GPU UUIDs (``GPU-...``) or garbage give ``()``.

    ``CUDA_VISIBLE_DEVICES`` may hold UUIDs or MIG names; those are not indexes, and a
    wrong index is worse than none, so any non-integer item voids the whole list.
    """
    if not text:
        return ()
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not all(item.isdigit() for item in items):
        return ()
    return tuple(int(item) for item in items)


def _int_or_none(text: str | None) -> int | None:
    if text is None or not text.strip().lstrip("-").isdigit():
        return None
    return int(text)


@dataclass(frozen=True)
class JobEnv:
    """What a Slurm job, Prolog or Epilog knows about its job from the environment."""

    job_id: str
    restart_count: int = 0
    """0 on the first run, N after N requeues."""
    gpus: tuple[int, ...] = ()
    """GPU indexes on the node (``SLURM_JOB_GPUS``, else ``CUDA_VISIBLE_DEVICES``)."""
    uid: int | None = None
    user: str | None = None
    comment: str | None = None
    node: str | None = None
    partition: str | None = None
    shards: int = 0
    """Shard GRES units on this node (``--gres=shard:N``); its GPU is in ``gpus``."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobEnv | None:
        """The job seen in ``env`` (default ``os.environ``); None outside a Slurm job."""
        env = os.environ if env is None else env
        job_id = _first(env, "job_id")
        if job_id is None:
            return None
        return cls(
            job_id=job_id,
            restart_count=max(0, _int_or_none(_first(env, "restart_count")) or 0),
            gpus=parse_gpu_list(_first(env, "gpus")),
            uid=_int_or_none(_first(env, "uid")),
            user=_first(env, "user"),
            comment=_first(env, "comment"),
            node=_first(env, "node"),
            partition=_first(env, "partition"),
            shards=max(0, _int_or_none(_first(env, "shards")) or 0),
        )

    @property
    def is_restart(self) -> bool:
        """True when this run follows a requeue or preemption."""
        return self.restart_count > 0
