"""spswap: a Slurm-native model-swap manager for vLLM on shared GPU nodes."""

__version__ = "0.1.0"
