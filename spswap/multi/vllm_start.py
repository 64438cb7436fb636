"""A vLLM model of a multi-model job: where its weights come from, as ``spswap serve
--engine vllm`` does it for one model (:mod:`spswap.serve.vllm_run`).

The pool entry a vLLM engine starts from holds the weights *as vLLM holds them* (its
identity: vLLM version, dtype, parallel layout, config): when one is there the engine
starts with dummy weights filled from it (no disk read); else it starts cold from the
model's files and exports its weights once (:func:`spswap.serve.vllm_export.export_weights`:
root writes the pool, a user's export goes through spswapd), then maps the new entry for
its wakes. vLLM is imported only inside the engine process (:func:`start_engine`,
:func:`llm_overrides`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from spswap.engines.vllm_engine import VllmSettings, engine_identity
from spswap.engines.vllm_identity import find_entry, use_found_entry
from spswap.errors import ConfigError
from spswap.multi.procs import ModelSpec
from spswap.serve.vllm_api import installed_vllm_version
from spswap.serve.vllm_export import export_weights


def vllm_specs(pool: Any, paths: tuple[Path, ...],
               settings: VllmSettings) -> tuple[list[ModelSpec], list[Any]]:  # fmt: skip
    """Each model's spec with the pool entry its engine will start from (``""`` where
    there is none yet: its first start exports one), and the entries found. No vLLM
    import: its version from the package's metadata (a clear error when it is missing)."""
    version = installed_vllm_version()
    specs, found = [], []
    for p in paths:
        entry = find_entry(pool, engine_identity(p, settings, version))
        specs.append(ModelSpec(p.name, p, entry.digest if entry is not None else ""))
        if entry is not None:
            found.append(entry)
    return specs, found


def start_engine(engine: Any, pool: Any, uses: contextlib.ExitStack) -> dict[str, Any]:
    """Start a :class:`~spswap.engines.vllm_engine.VllmEngine` from the pool, or cold
    from its files and export it (once); the entry it came from stays in use (``uses``)
    and attached for its wakes. Returns ``from`` (``pool``/``checkpoint``), ``digest``."""
    identity = engine.identity()
    entry, damaged = use_found_entry(pool, identity, uses)
    if entry is not None:
        report = engine.load_from_pool(pool, entry.digest)
        return {"from": "pool", "digest": entry.digest, "copy": report.to_json()}
    engine.load_from_checkpoint(engine.model_dir)
    digest = export_weights(engine, pool, identity, engine.model_dir.name,
                            engine.settings.tensor_parallel_size)  # fmt: skip
    uses.enter_context(pool.use(digest))
    engine.attach(pool, digest)
    return {"from": "checkpoint", "digest": digest, **({"damaged": damaged} if damaged else {})}


def llm_overrides(model: Path, vllm_args: list[str]) -> dict[str, Any]:
    """vLLM's own command-line options (``--max-num-seqs 8 --enable-prefix-caching``) as
    ``vllm.LLM`` keyword arguments: those that differ from vLLM's defaults, parsed by
    vLLM's own parser (imported here: call it in the engine process)."""
    if not vllm_args:
        return {}
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="--vllm-args"))
    base = ["--model", str(model)]
    try:
        given = vars(parser.parse_args([*base, *vllm_args]))
    except SystemExit:
        raise ConfigError(f"--vllm-args {' '.join(vllm_args)!r}: vLLM does not take these "
                          "(its message is above); see `vllm serve --help`") from None  # fmt: skip
    default = vars(parser.parse_args(base))
    return {k: v for k, v in given.items() if k != "model" and default.get(k) != v}
