"""A running vLLM server's weights into the node's pool, once per identity, so every
later start of the same model, settings and vLLM is filled from the pool (no disk read).

Root writes the pool directly; a user's export is a private file that spswapd imports
through its descriptor, stamped with the user's uid.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from spswap import access
from spswap.errors import EngineError
from spswap.pool.index import alias_key


class RpcTarget(Protocol):
    """What holds the weights: vLLM's server (:class:`spswap.serve.vllm_api.VllmApiServer`)
    or an engine in this process (:class:`spswap.engines.vllm_engine.VllmEngine`)."""

    def rpc(self, method: str, *args: Any) -> dict[str, Any]: ...


def export_weights(server: RpcTarget, pool: Any, identity: dict[str, Any], model_name: str,
                   tensor_parallel_size: int) -> str:  # fmt: skip
    """Export ``server``'s weights (as vLLM holds them) to ``pool`` as ``vllm-MODEL``;
    returns the entry's digest."""
    name = f"vllm-{model_name}"
    layout = {k: v for k, v in identity.items() if k not in ("rank", "tp_size")}
    if access.privileged():  # (looked up at each call: tests play a user)
        layout["owner_uid"] = os.getuid()
        out = server.rpc("spswap_export", str(pool.pool_dir), name, layout)
        # found by this identity next time, even if the bytes were there already
        pool.remember_alias(alias_key(identity, os.getuid()), str(out["digest"]))
        return str(out["digest"])
    if tensor_parallel_size != 1:
        raise EngineError(
            "exporting a tensor-parallel engine's weights through spswapd is not supported "
            "yet: run with --tensor-parallel-size 1, or export once as root"
        )
    # mkdtemp: a fresh 0700 directory no one else can rename or fill (in $TMPDIR,
    # job-private under many Slurm setups), so the file imported is the one written
    export_dir = Path(tempfile.mkdtemp(prefix="spswap-export-"))
    path = export_dir / f"{name}.safetensors"
    try:
        server.rpc("spswap_export_file", str(path))
        manifest = pool.import_checkpoint(path, name=name, identity=identity)
    finally:
        shutil.rmtree(export_dir, ignore_errors=True)
    return str(manifest.digest)
