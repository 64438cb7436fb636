"""The reference engine on CPU: real checkpoints, a real pool, real sleep and wake."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from spswap.engines.protocol import Engine  # noqa: E402
from spswap.engines.reference import (  # noqa: E402
    ReferenceEngine,
    load_config,
    save_checkpoint,
)
from spswap.engines.reference_model import PRESETS, ReferenceConfig, init_weights, preset  # noqa: E402
from spswap.errors import ConfigError, EngineError, IllegalTransition, TransferError  # noqa: E402
from spswap.instance.state import State  # noqa: E402
from spswap.pool.store import Pool  # noqa: E402

CFG = ReferenceConfig(vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, ffn_size=64,
                      max_seq_len=64, seed=3)  # fmt: skip
PROMPTS = [[1, 2, 3], [50, 7], [96]]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return save_checkpoint(CFG, tmp_path / "ckpt")


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    return Pool(tmp_path / "pool", capacity_bytes=1 << 30)


def test_engine_satisfies_the_protocol() -> None:
    assert isinstance(ReferenceEngine(CFG, "cpu"), Engine)


def test_weights_are_deterministic_per_seed() -> None:
    a, b = init_weights(CFG), init_weights(CFG)
    c = init_weights(preset("tiny", seed=4, vocab_size=97, hidden_size=32, n_layers=2,
                            n_heads=4, ffn_size=64, max_seq_len=64))  # fmt: skip
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a if not k.endswith("norm.weight"))
    assert sum(t.numel() for t in a.values()) == CFG.param_count


def test_presets_and_config_round_trip(ckpt: Path) -> None:
    assert load_config(ckpt) == CFG
    assert PRESETS["tiny"].weight_bytes < 16 << 20
    assert 40 << 20 < PRESETS["small"].weight_bytes < 120 << 20
    assert 0.9e9 < PRESETS["1g"].weight_bytes < 1.3e9
    assert 3.5e9 < PRESETS["4g"].weight_bytes < 4.5e9
    with pytest.raises(ConfigError, match="presets: tiny, small"):
        preset("huge")
    with pytest.raises(ConfigError, match="multiple of n_heads"):
        ReferenceConfig(hidden_size=30, n_heads=4)


def test_generation_is_deterministic_and_depends_on_the_weights(ckpt: Path, tmp_path) -> None:
    e1, e2 = ReferenceEngine(CFG, "cpu"), ReferenceEngine(CFG, "cpu")
    e1.load_from_checkpoint(ckpt)
    e2.load_from_checkpoint(ckpt / "model.safetensors")
    out = e1.generate(PROMPTS, 12)
    assert [len(o) for o in out] == [12, 12, 12]
    assert all(0 <= t < CFG.vocab_size for o in out for t in o)
    assert e1.generate(PROMPTS, 12) == out == e2.generate(PROMPTS, 12)
    other_cfg = ReferenceConfig(**{**CFG.to_json(), "seed": 9})
    other = ReferenceEngine(other_cfg, "cpu")
    other.load_from_checkpoint(save_checkpoint(other_cfg, tmp_path / "other"))
    assert other.generate(PROMPTS, 12) != out


@pytest.mark.parametrize("device", DEVICES)
def test_pool_load_equals_cold_load_and_sleep_wake_keeps_answers(
    ckpt: Path, pool: Pool, device: str
) -> None:
    cold = ReferenceEngine(CFG, device)
    cold.load_from_checkpoint(ckpt)
    expected = cold.generate(PROMPTS, 10)
    cold.close()

    m = pool.import_checkpoint(ckpt, name="m")
    eng = ReferenceEngine(CFG, device, name="m")
    report = eng.load_from_pool(pool, "m")
    assert report.size_bytes == CFG.weight_bytes
    assert eng.generate(PROMPTS, 10) == expected
    assert eng.health().source == f"pool:{m.digest}"
    # The entry is in use while the engine holds it.
    assert any(e.users for e in pool.entries() if e.manifest.digest == m.digest)

    for _ in range(3):
        eng.sleep()
        info = eng.health()
        assert info.state is State.SLEEP and info.resident_bytes == 0
        assert info.weight_bytes == CFG.weight_bytes
        # nothing of the weights held: freed (CUDA) or no longer bound to the pool (CPU)
        assert all(p.untyped_storage().nbytes() <= p.element_size()
                   for p in eng._loaded().parameters())  # fmt: skip
        with pytest.raises(EngineError, match="wake it first"):
            eng.generate(PROMPTS, 1)
        rep = eng.wake()
        assert rep.size_bytes == CFG.weight_bytes
        assert eng.health().resident_bytes == CFG.weight_bytes
        assert eng.generate(PROMPTS, 10) == expected
    hist = [h["primitive"] for h in eng.instance.history]
    assert hist == ["sleep", "wake"] * 3
    eng.close()
    assert not any(e.users for e in pool.entries() if e.manifest.digest == m.digest)


def test_on_cpu_the_weights_are_the_pools_pages_not_a_copy(ckpt: Path, pool: Pool) -> None:
    pool.import_checkpoint(ckpt, name="m")
    eng = ReferenceEngine(CFG, "cpu", name="m")
    report = eng.load_from_pool(pool, "m")
    assert report.mapped and report.size_bytes == CFG.weight_bytes
    mapping = eng._mapping
    assert mapping is not None
    lo, hi = mapping.address, mapping.address + mapping.size_bytes

    def inside() -> list[bool]:
        return [lo <= p.data_ptr() < hi for p in eng._loaded().parameters()]

    assert all(inside())
    assert eng.health().resident_bytes == CFG.weight_bytes and eng.health().details["mapped"]
    eng.sleep()
    assert not any(inside()) and eng.health().resident_bytes == 0
    assert eng.wake().mapped and all(inside())
    assert eng.generate(PROMPTS, 4) == eng.generate(PROMPTS, 4)
    eng.close()
    assert not any(e.users for e in pool.entries())


def test_illegal_transitions_raise(ckpt: Path, pool: Pool) -> None:
    pool.import_checkpoint(ckpt, name="m")
    eng = ReferenceEngine(CFG, "cpu")
    with pytest.raises(EngineError, match="holds no weights"):
        eng.sleep()
    eng.load_from_pool(pool, "m")
    with pytest.raises(IllegalTransition, match="cannot wake from state up"):
        eng.wake()
    eng.sleep()
    with pytest.raises(IllegalTransition, match="cannot sleep from state sleep"):
        eng.sleep()
    assert eng.state is State.SLEEP
    eng.wake()
    assert eng.state is State.UP


def test_cold_loaded_engine_refuses_to_sleep(ckpt: Path) -> None:
    eng = ReferenceEngine(CFG, "cpu")
    eng.load_from_checkpoint(ckpt)
    with pytest.raises(EngineError, match="load it with load_from_pool"):
        eng.sleep()
    assert eng.state is State.UP and eng.generate([[1]], 2)


def test_wrong_model_in_pool_is_refused_and_engine_unchanged(ckpt: Path, pool: Pool, tmp_path):
    bigger = ReferenceConfig(**{**CFG.to_json(), "ffn_size": 128})
    pool.import_checkpoint(save_checkpoint(bigger, tmp_path / "big"), name="big")
    eng = ReferenceEngine(CFG, "cpu")
    with pytest.raises(TransferError, match="w_gate.weight: shape"):
        eng.load_from_pool(pool, "big")
    with pytest.raises(EngineError, match="holds no weights"):
        eng.generate([[1]], 1)
    assert not any(e.users for e in pool.entries())
    with pytest.raises(EngineError, match="does not match the reference config"):
        eng.load_from_checkpoint(tmp_path / "big")


def test_export_then_load_from_pool_round_trips(ckpt: Path, pool: Pool) -> None:
    eng = ReferenceEngine(CFG, "cpu")
    eng.load_from_checkpoint(ckpt)
    expected = eng.generate(PROMPTS, 8)
    m = eng.export_weights(pool, "exported")
    assert m.identity["engine"] == "reference" and m.identity["config"] == CFG.to_json()
    assert m.digest == pool.import_checkpoint(ckpt, name="imported").digest
    fresh = ReferenceEngine(CFG, "cpu")
    fresh.load_from_pool(pool, "exported")
    assert fresh.generate(PROMPTS, 8) == expected


def test_prompt_validation(ckpt: Path) -> None:
    from spswap.errors import RequestRejected

    eng = ReferenceEngine(CFG, "cpu")
    eng.load_from_checkpoint(ckpt)
    with pytest.raises(RequestRejected, match="more than the model's 64 positions"):
        eng.generate([[1] * 60], 5)
    with pytest.raises(RequestRejected, match=r"\[0, 97\)"):
        eng.generate([[97]], 1)
    with pytest.raises(RequestRejected, match="empty prompt"):
        eng.generate([[]], 1)


def test_cpu_threads_come_from_the_setting() -> None:
    import torch

    from spswap.engines.reference import set_cpu_threads
    from spswap.errors import EngineError

    before = torch.get_num_threads()
    try:
        assert set_cpu_threads({"SPSWAP_CPU_THREADS": "2"}) == 2 == torch.get_num_threads()
        assert set_cpu_threads({}) == 1 == torch.get_num_threads()
        with pytest.raises(EngineError, match="SPSWAP_CPU_THREADS='many' is not a number"):
            set_cpu_threads({"SPSWAP_CPU_THREADS": "many"})
    finally:
        torch.set_num_threads(before)
