"""``spswap models make`` / ``check``, and ``spswap serve`` refusing a model its engine
cannot serve before the model goes into the pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from spswap.engines.model_check import check_servable  # noqa: E402
from spswap.engines.reference import ReferenceEngine, load_config  # noqa: E402
from spswap.engines.vllm_engine import available  # noqa: E402
from spswap.errors import ConfigError  # noqa: E402


def spswap(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPSWAP_"))}
    return subprocess.run([sys.executable, "-m", "spswap.cli", *args], capture_output=True,
                          text=True, timeout=180, env=env, cwd=cwd)  # fmt: skip


def hf_model(d: Path) -> Path:
    """A Hugging Face-style directory (what `huggingface-cli download` leaves)."""
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    (d / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8})
    )
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, str(d / "model.safetensors"))
    return d


def test_models_make_writes_a_model_the_reference_engine_serves(tmp_path: Path) -> None:
    proc = spswap("models", "make", str(tmp_path / "m"), "--preset", "tiny", "--seed", "3",
                  "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["engine"] == "reference" and out["preset"] == "tiny" and out["seed"] == 3
    assert out["path"] == str((tmp_path / "m").resolve())
    config = load_config(tmp_path / "m")
    assert config.seed == 3 and out["weight_bytes"] == config.weight_bytes
    check_servable("reference", tmp_path / "m")
    with ReferenceEngine(config, "cpu") as eng:
        eng.load_from_checkpoint(tmp_path / "m")
        assert len(eng.generate([[1, 2, 3]], 4)[0]) == 4


def test_models_make_says_how_to_serve_and_refuses_a_used_directory(tmp_path: Path) -> None:
    proc = spswap("models", "make", str(tmp_path / "m"), "--preset", "tiny")
    assert proc.returncode == 0, proc.stderr
    assert f"serve it in a Slurm job: spswap serve {(tmp_path / 'm').resolve()}" in proc.stdout
    again = spswap("models", "make", str(tmp_path / "m"), "--preset", "tiny")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "exists and is not an empty directory: give a new directory" in again.stderr
    bad = spswap("models", "make", str(tmp_path / "n"), "--preset", "huge")
    assert bad.returncode == 2 and "unknown reference preset 'huge'" in bad.stderr
    assert "tiny, small, 1g, 4g" in bad.stderr


def test_serve_refuses_a_hugging_face_model_before_importing_it(tmp_path: Path) -> None:
    model = hf_model(tmp_path / "qwen")
    root = tmp_path / "root"
    proc = spswap("serve", str(model), "--state-dir", str(tmp_path / "s"), "--root", str(root))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    err = " ".join(proc.stderr.split())
    assert f"{model} is a Hugging Face-style model (Qwen2ForCausalLM)" in err
    assert f"spswap serve {model} --engine vllm" in err
    assert "spswap models make DIR --preset small" in err
    assert "unknown reference config keys" not in err
    pool = root / "pool"
    assert not pool.exists() or not [p for p in pool.iterdir() if len(p.name) == 64]


def test_serve_with_vllm_refuses_a_reference_model(tmp_path: Path) -> None:
    assert spswap("models", "make", str(tmp_path / "m"), "--preset", "tiny").returncode == 0
    proc = spswap("serve", str(tmp_path / "m"), "--engine", "vllm", "--state-dir",
                  str(tmp_path / "s"), "--root", str(tmp_path / "root"))  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is a reference model (made by `spswap models make`): vLLM cannot serve it" in (
        " ".join(proc.stderr.split())
    )


def test_check_names_what_is_wrong(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="has no config.json: the reference engine"):
        check_servable("reference", empty)
    with pytest.raises(ConfigError, match="has no config.json: vLLM"):
        check_servable("vllm", empty)
    check_servable("vllm", hf_model(tmp_path / "hf"))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"hidden": 3}))
    with pytest.raises(ConfigError, match=r"is not a reference model's \(unknown reference"):
        check_servable("reference", odd)
    with pytest.raises(ConfigError, match="unknown engine 'tgi'; valid engines: reference, vllm"):
        check_servable("tgi", odd)
    # weights that do not match their config (the config edited after `models make`)
    assert spswap("models", "make", str(tmp_path / "m"), "--preset", "tiny").returncode == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "n_layers": 3}))
    with pytest.raises(ConfigError, match="does not match .*config.json"):
        check_servable("reference", tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        check_servable("reference", tmp_path / "m")


def test_models_check_command(tmp_path: Path) -> None:
    model = hf_model(tmp_path / "qwen")
    proc = spswap("models", "check", str(model))
    assert proc.returncode == 2 and "--engine vllm" in proc.stderr
    proc = spswap("models", "check", str(model), "--engine", "vllm")
    assert proc.returncode == 0 and "can serve it" in proc.stdout
    # a walk: the check passed on a host without vLLM and said nothing of it
    note = "note: vLLM is not installed in this Python; the nodes that run the job need it"
    assert (note in " ".join(proc.stdout.split())) is not available(), proc.stdout
    proc = spswap("models", "check", str(model), "--engine", "vllm", "--json")
    assert json.loads(proc.stdout)["vllm_installed"] is available()


def test_a_made_model_is_as_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """safetensors writes its file 0600: a model one user makes for the group's jobs was
    unreadable to them while its config.json was not."""
    old = os.umask(0o022)
    try:
        proc = spswap("models", "make", str(tmp_path / "m"), "--preset", "tiny")
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644}


def test_a_hugging_face_model_without_usable_weights_is_told_before_a_job(tmp_path: Path) -> None:
    """A walk: `models check --engine vllm` said "ok" for a directory with no weights, a
    0-byte model.safetensors and a garbage one; the GPU node would have found out."""
    good = hf_model(tmp_path / "good")
    check_servable("vllm", good)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"bad has no weights \(\*\.safetensors\): a Hugging"):
        check_servable("vllm", bad)
    (bad / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="model.safetensors: only 0 bytes, too short"):
        check_servable("vllm", bad)
    (bad / "model.safetensors").write_bytes(b"garbage\n")
    with pytest.raises(ConfigError, match="model.safetensors: not a safetensors file"):
        check_servable("vllm", bad)
    (bad / "model.safetensors").unlink()
    (bad / "pytorch_model.bin").write_bytes(b"x")  # vLLM's to read: present is enough here
    check_servable("vllm", bad)
