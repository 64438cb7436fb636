"""Slurm access: every Slurm token spswap uses lives in this package.

- :mod:`spswap.slurm.env`: the job's own view of Slurm (job id, restart count, GPUs,
  uid) from the environment of a job, a Prolog or an Epilog, as data.
- :mod:`spswap.slurm.parse`: pure parsers of ``scontrol show job -o`` and ``squeue --json``,
  and what Slurm's job state names mean (allocated, running, coming back, gone).
- :mod:`spswap.slurm.backend`: the controller: query, requeue, signal, cancel, through
  pyslurm where a matching one imports, through scontrol/squeue/scancel otherwise.
"""

from spswap.slurm.env import JobEnv
from spswap.slurm.parse import JobInfo

__all__ = ["JobEnv", "JobInfo"]
