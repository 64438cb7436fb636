"""Answers bigger than a request may be: a real model's manifest through a real spswapd."""

from __future__ import annotations

import numpy as np
import pytest

from spswap import access
from spswap.config import Config
from spswap.daemon import protocol
from spswap.daemon.client import Client
from spswap.errors import ProtocolError
from spswap.pool.manifest import Manifest
from tests.pool.st_files import write_st

# Qwen2.5-3B has 434 tensors with names like this one; its manifest was 81806 bytes, past
# the 64 KiB request bound, and `spswap serve` of it failed in every run (H200, turns).
N_TENSORS = 600


def _many_tensors() -> dict[str, np.ndarray]:
    return {f"model.layers.{i // 12}.self_attn.q_proj_with_a_long_suffix_{i % 12}.weight":
            np.full((3, 5), i, dtype=np.float32) for i in range(N_TENSORS)}  # fmt: skip


def test_pool_use_answers_a_manifest_past_the_request_bound(
    cfg: Config, daemon: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = write_st(tmp_path_factory.mktemp("big") / "model.safetensors", _many_tensors())
    digest = access.import_model(cfg, path, name="many").digest
    answer = Client(cfg).call("pool.use", ref="many")
    assert len(protocol.encode(protocol.ok(answer))) > protocol.MAX_MESSAGE_BYTES
    manifest = Manifest.from_json(answer)
    assert manifest.digest == digest
    assert len(manifest.tensors) == N_TENSORS
    Client(cfg).call("pool.unuse", ref=digest)


def test_a_request_past_its_bound_is_still_refused() -> None:
    line = protocol.encode(protocol.request("pool.use", ref="x" * protocol.MAX_MESSAGE_BYTES))
    with pytest.raises(ProtocolError, match="send smaller requests"):
        protocol.decode_request(line)


def test_an_answer_past_its_bound_is_refused() -> None:
    line = protocol.encode(protocol.ok("x" * protocol.MAX_RESPONSE_BYTES))
    with pytest.raises(ProtocolError, match="larger than the limit"):
        protocol.decode_response(line)
