"""Which engine serves a model directory, checked before ``spswap serve`` imports it into
the node's pool: a model the engine cannot load is refused with what serves it instead.

The reference engine serves only the models ``spswap models make`` writes (its own
``config.json`` and ``model.safetensors``); vLLM serves Hugging Face-style models (a
``config.json`` naming ``architectures`` / ``model_type``, safetensors weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spswap.errors import ConfigError, InvalidCheckpoint
from spswap.install_hint import needs_torch
from spswap.pool.safetensors_format import read_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# weight files vLLM also loads (PyTorch's): present, they are left to vLLM to read
HF_OTHER_WEIGHTS = ("*.bin", "*.pt")
HF_KEYS = ("architectures", "model_type")
# Keys only a reference model's config.json has together (see ReferenceConfig).
REFERENCE_MARKS = ("n_layers", "n_heads", "ffn_size")
MAKE_HINT = "make one with `spswap models make DIR --preset small`"
ENGINES = ("reference", "vllm")


def check_engine_name(engine: str) -> None:
    """ConfigError unless ``engine`` names one of spswap's engines (``--engine``)."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; valid engines: {', '.join(ENGINES)}")


def read_config(model: Path) -> dict[str, Any] | None:
    """``model/config.json`` as a dict; None when there is none. Raises for one that is
    not a JSON object."""
    path = Path(model) / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object; a model's config.json is one")
    return data


def is_hf_config(cfg: dict[str, Any]) -> bool:
    return any(k in cfg for k in HF_KEYS)


def is_reference_config(cfg: dict[str, Any]) -> bool:
    return not is_hf_config(cfg) and all(k in cfg for k in REFERENCE_MARKS)


def _hf_names(cfg: dict[str, Any]) -> str:
    arch = cfg.get("architectures")
    if isinstance(arch, list) and arch:
        return ", ".join(map(str, arch))
    return str(cfg.get("model_type") or "a Hugging Face model")


def check_servable(engine: str, model: Path) -> None:
    """Raise :class:`ConfigError` when ``engine`` cannot serve ``model``, naming the engine
    that can (or how to make a model this one serves)."""
    check_engine_name(engine)
    if engine == "reference":
        check_reference(model)
    else:
        check_vllm(model)


def check_vllm(model: Path) -> None:
    cfg = read_config(model)
    if cfg is None:
        raise ConfigError(
            f"{model} has no {CONFIG_FILE}: vLLM (--engine vllm) serves Hugging Face-style "
            f"models ({CONFIG_FILE} + *.safetensors, e.g. as downloaded with "
            "`huggingface-cli download`)"
        )
    if is_reference_config(cfg):
        raise ConfigError(
            f"{model} is a reference model (made by `spswap models make`): vLLM cannot "
            "serve it; serve it with the reference engine (leave out --engine vllm), or "
            "give --engine vllm a Hugging Face-style model"
        )
    _check_hf_weights(model)


def _check_hf_weights(model: Path) -> None:
    """A Hugging Face-style model's weight files are there and each safetensors file's
    header reads (not its data): a download cut short, an empty or a stray file is told
    here, not when a GPU node loads it."""
    files = sorted(Path(model).glob("*.safetensors"))
    others = [p for pat in HF_OTHER_WEIGHTS for p in Path(model).glob(pat)]
    if not files and not others:
        raise ConfigError(
            f"{model} has no weights (*.safetensors): a Hugging Face-style model is "
            f"{CONFIG_FILE} + its weight files; download them too (e.g. `huggingface-cli "
            "download REPO --local-dir DIR`)"
        )
    for path in files:
        try:
            tensors = read_safetensors(path).tensors
        except InvalidCheckpoint as e:
            raise ConfigError(str(e)) from None
        if not tensors:
            raise ConfigError(f"{path} holds no tensors: fetch that file again")


def check_reference(model: Path) -> None:
    """The reference engine's checks: its config, its weights file, their shapes."""
    cfg = read_config(model)
    if cfg is None:
        raise ConfigError(
            f"{model} has no {CONFIG_FILE}: the reference engine (the default) serves only "
            f"models made by `spswap models make`; {MAKE_HINT}"
        )
    if is_hf_config(cfg):
        raise ConfigError(
            f"{model} is a Hugging Face-style model ({_hf_names(cfg)}): the reference engine "
            "(the default) serves only models made by `spswap models make`. Serve it with "
            f"`spswap serve {model} --engine vllm` (on a GPU node), or {MAKE_HINT}"
        )
    try:
        from spswap.engines.reference_model import ReferenceConfig
    except ImportError as e:
        raise ConfigError(needs_torch("the reference engine", e)) from None
    try:
        config = ReferenceConfig.from_json(cfg)
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(
            f"{model}/{CONFIG_FILE} is not a reference model's ({e}); the reference engine "
            f"serves only models made by `spswap models make`: {MAKE_HINT}, or serve a "
            "Hugging Face-style model with --engine vllm"
        ) from None
    _check_weights(model, config)


def _check_weights(model: Path, config: Any) -> None:
    from spswap.engines.reference_model import expected_shapes

    path = Path(model) / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError(
            f"{model} has no {WEIGHTS_FILE}: a reference model is {CONFIG_FILE} + "
            f"{WEIGHTS_FILE}; {MAKE_HINT}"
        )
    try:
        got = {t.name: (t.dtype, t.shape) for t in read_safetensors(path).tensors}
    except InvalidCheckpoint as e:
        raise ConfigError(str(e)) from None
    want = {n: (config.dtype, s) for n, s in expected_shapes(config).items()}
    if got != want:
        diff = sorted(set(want.items()) ^ set(got.items()))[:3]
        raise ConfigError(
            f"{path} does not match {model}/{CONFIG_FILE} (first differences: {diff}): "
            f"the weights were not written for this config; {MAKE_HINT}"
        )
