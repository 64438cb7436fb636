"""Checkpoint and restore of model processes: CRIU (``criu``) and CUDA (``cuda_ckpt``).

Every CRIU token lives in :mod:`spswap.checkpoint.criu_argv` (argv, pure) and
:mod:`spswap.checkpoint.criu` (runs it); every CUDA driver checkpoint call lives in
:mod:`spswap.checkpoint.cuda_ckpt`. Each has an ``available()`` probe.
"""
