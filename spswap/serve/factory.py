"""Build the engine ``spswap serve`` was asked for (torch and vLLM imported here only)."""

from __future__ import annotations

from spswap.engines.protocol import Engine
from spswap.errors import ConfigError
from spswap.install_hint import needs_torch
from spswap.serve.runtime import ServeOptions

ENGINES = ("reference",)


def make_engine(opts: ServeOptions) -> Engine:
    """A fresh, empty engine of kind ``opts.engine`` for the model in ``opts.model``."""
    if opts.engine == "reference":
        try:
            from spswap.engines.reference import ReferenceEngine, load_config
        except ImportError as e:
            raise ConfigError(needs_torch("the reference engine", e)) from e
        return ReferenceEngine(load_config(opts.model), opts.device, name=opts.model.name)
    raise ConfigError(f"unknown engine {opts.engine!r}; valid engines: {', '.join(ENGINES)}")
