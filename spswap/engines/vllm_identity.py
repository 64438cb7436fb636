"""Which pool entry fits a vLLM engine: weights exported by an engine of the same vLLM
version, dtype, parallel layout, model config and weight files, by a user the loader
trusts. Plain files and hashes: no vLLM, no torch."""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from spswap.errors import EngineError, PoolCorrupt, PoolEntryNotFound
from spswap.pool.index import alias_key

# Identity keys that must match for a pool entry to fit an engine's weight layout.
IDENTITY_KEYS = ("engine", "vllm", "tp_size", "rank", "dtype", "model_config_hash", "weights")


def model_config_hash(model_dir: Path) -> str:
    """sha256 of the model's ``config.json`` with sorted keys: the weight layout vLLM
    builds depends on it (shapes, tying, architecture), not on where the file lives."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(f"{path} not found: a vLLM model directory needs config.json") from None
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def weights_fingerprint(model_dir: Path) -> str:
    """Which weight files the model directory holds: sha256 over each ``*.safetensors``
    (and index) file's name, size, times and inode, without reading them. Two checkpoints
    of one training run share config.json; this tells them apart (a copied or touched
    file counts as new: one more export, never the wrong weights). A file rewritten in
    place changes its ctime, which no user can set back: stat is enough, no hashing."""
    d = Path(model_dir)
    files = sorted([*d.glob("*.safetensors"), *d.glob("*.safetensors.index.json")])
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        # size and mtime alone repeat across checkpoints of one model whose times were
        # preserved (tar, rsync -a): the inode and its change time tell them apart
        h.update(
            f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_dev}\0{st.st_ino}\0"
            f"{st.st_ctime_ns}\n".encode()
        )
    return h.hexdigest()


def identity_matches(entry_identity: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether an entry's identity fits: every key of :data:`IDENTITY_KEYS` equal."""
    return all(entry_identity.get(k) == wanted.get(k) for k in IDENTITY_KEYS)


def trusted_owner(entry_identity: dict[str, Any], uid: int) -> bool:
    """Whether an exported entry may be loaded by ``uid``: exported by that user or by
    root through spswapd (``owner_uid``), or written into the pool directly (no
    ``owner_uid``: only the pool's owner can do that)."""
    owner = entry_identity.get("owner_uid")
    return owner is None or owner in (0, uid)


def find_entry(pool: Any, identity: dict[str, Any], uid: int | None = None) -> Any | None:
    """The pool entry (a Manifest) for ``identity``: the one recorded for it as exported by
    ``uid`` (default: this process's user) or root, else the newest whose identity
    matches and whose exporter ``uid`` trusts (:func:`trusted_owner`), or None."""
    uid = os.getuid() if uid is None else uid
    for who in dict.fromkeys((uid, 0)):  # exported (or re-exported: same bytes) by uid, root
        hit = pool.find_alias(alias_key(identity, who))
        if hit is not None:
            return hit
    hits = [e.manifest for e in pool.entries()
            if identity_matches(e.manifest.identity, identity)
            and trusted_owner(e.manifest.identity, uid)]  # fmt: skip
    return max(hits, key=lambda m: m.created) if hits else None


def use_found_entry(pool: Any, identity: dict[str, Any], uses: ExitStack
                    ) -> tuple[Any | None, str | None]:  # fmt: skip
    """:func:`find_entry`'s entry, with a use of it held in ``uses``: ``(entry, None)``;
    ``(None, None)`` where there is none; ``(None, why)`` where the one found had been
    written over since it was sealed and was damaged (spswapd removed it: the caller
    starts from the model's files and exports it again)."""
    entry = find_entry(pool, identity)
    if entry is None:
        return None, None
    try:
        uses.enter_context(pool.use(entry.digest))
    except (PoolCorrupt, PoolEntryNotFound) as e:  # (not found: removed since it was found)
        return None, str(e)
    return entry, None
