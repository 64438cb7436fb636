"""The reference engine's cold answers: what every swap test compares a server's answers
with."""

from __future__ import annotations

import hashlib
from pathlib import Path

from spswap.engines.reference import CONFIG_FILE, WEIGHTS_FILE, ReferenceEngine, load_config


def cold_answers(model: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer from a fresh engine that reads the checkpoint (its
    config from the model's own config.json), one prompt at a time as servers answer.

    Kept for the test session by the checkpoint's content: most tests make the same model
    in a directory of their own, and its answers cost seconds on a CI machine's CPU."""
    model = Path(model)
    digest = hashlib.sha256((model / CONFIG_FILE).read_bytes())
    with open(model / WEIGHTS_FILE, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    key = (digest.hexdigest(), tuple(tuple(int(t) for t in p) for p in prompts), max_new_tokens)
    if key not in _ANSWERS:
        eng = ReferenceEngine(load_config(model), "cpu")
        eng.load_from_checkpoint(model)
        try:
            _ANSWERS[key] = [eng.generate([list(p)], max_new_tokens)[0] for p in key[1]]
        finally:
            eng.close()
    return [list(a) for a in _ANSWERS[key]]


# the test session's answers by (checkpoint content, prompts, max_new_tokens)
_ANSWERS: dict[tuple[str, tuple[tuple[int, ...], ...], int], list[list[int]]] = {}
