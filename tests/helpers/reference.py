"""The reference engine's cold answers: what every swap test compares a server's answers
with."""

from __future__ import annotations

from pathlib import Path

from spswap.engines.reference import ReferenceEngine, load_config


def cold_answers(model: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer from a fresh engine that reads the checkpoint (its
    config from the model's own config.json), one prompt at a time as servers answer."""
    eng = ReferenceEngine(load_config(model), "cpu")
    eng.load_from_checkpoint(model)
    try:
        return [eng.generate([p], max_new_tokens)[0] for p in prompts]
    finally:
        eng.close()
