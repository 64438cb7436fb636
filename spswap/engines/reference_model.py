"""The reference engine's network: a small pre-norm decoder-only transformer.

Learned absolute positions, RMSNorm, causal multi-head attention, a gated MLP. No KV
cache: each generated token recomputes the whole sequence, which keeps the code short
and the results bit-identical for identical weights on one device.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from spswap.errors import ConfigError
from spswap.transfer.dtypes import to_torch


@dataclass(frozen=True)
class ReferenceConfig:
    """Shape and seed of a reference model. ``dtype`` is a safetensors name ("F32", "BF16")."""

    vocab_size: int = 1024
    hidden_size: int = 256
    n_layers: int = 2
    n_heads: int = 4
    ffn_size: int = 1024
    max_seq_len: int = 256
    dtype: str = "F32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "ffn_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.n_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not a multiple of n_heads {self.n_heads}"
            )
        to_torch(self.dtype)  # raises on an unknown dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return to_torch(self.dtype)

    @property
    def param_count(self) -> int:
        h, f = self.hidden_size, self.ffn_size
        per_layer = 2 * h + 4 * h * h + 3 * h * f
        return 2 * self.vocab_size * h + self.max_seq_len * h + h + self.n_layers * per_layer

    @property
    def weight_bytes(self) -> int:
        return self.param_count * torch.empty(0, dtype=self.torch_dtype).element_size()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReferenceConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ConfigError(
                f"unknown reference config keys {sorted(unknown)}; valid: {sorted(known)}"
            )
        return cls(**d)


# Sizes: tiny ~10 MB, small ~80 MB (F32, CPU-friendly); 1g ~1.1 GB, 4g ~4 GB (BF16, GPU).
PRESETS: dict[str, ReferenceConfig] = {
    "tiny": ReferenceConfig(),
    "small": ReferenceConfig(
        vocab_size=4096, hidden_size=512, n_layers=4, n_heads=8, ffn_size=2048
    ),
    "1g": ReferenceConfig(
        vocab_size=32000,
        hidden_size=2048,
        n_layers=8,
        n_heads=16,
        ffn_size=5632,
        max_seq_len=512,
        dtype="BF16",
    ),
    "4g": ReferenceConfig(
        vocab_size=32000,
        hidden_size=3072,
        n_layers=16,
        n_heads=24,
        ffn_size=8192,
        max_seq_len=512,
        dtype="BF16",
    ),
}


def preset(name: str, **overrides: Any) -> ReferenceConfig:
    """A preset config (``tiny``, ``small``, ``1g``, ``4g``) with fields overridden."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown reference preset {name!r}; presets: {', '.join(PRESETS)}"
        ) from None
    return replace(base, **overrides)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, c: ReferenceConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.n_heads = c.n_heads
        self.attn_norm = RMSNorm(h)
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, h, bias=False)
        self.wv = nn.Linear(h, h, bias=False)
        self.wo = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.w_gate = nn.Linear(h, c.ffn_size, bias=False)
        self.w_up = nn.Linear(h, c.ffn_size, bias=False)
        self.w_down = nn.Linear(c.ffn_size, h, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        d = h // self.n_heads
        y = self.attn_norm(x)
        q, k, v = (
            w(y).view(b, t, self.n_heads, d).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(d)
        attn = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1).to(v.dtype)
        x = x + self.wo((attn @ v).transpose(1, 2).reshape(b, t, h))
        y = self.mlp_norm(x)
        return x + self.w_down(nn.functional.silu(self.w_gate(y)) * self.w_up(y))


class Decoder(nn.Module):
    """Token ids ``[B, T]`` -> logits of the last position ``[B, vocab]``."""

    def __init__(self, c: ReferenceConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.pos = nn.Embedding(c.max_seq_len, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device)
        x = self.embed(ids) + self.pos(positions)
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(self.norm(x[:, -1]))


def build(config: ReferenceConfig, device: torch.device | str) -> Decoder:
    """The network with uninitialised weights on ``device`` (no init cost)."""
    with torch.device("meta"):
        model = Decoder(config).to(config.torch_dtype)  # meta: no memory, no init
    model = model.to_empty(device=device)
    model.requires_grad_(False)
    return model.eval()


def expected_shapes(config: ReferenceConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape for ``config`` (nothing allocated)."""
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in Decoder(config).named_parameters()}


def init_weights(config: ReferenceConfig) -> dict[str, torch.Tensor]:
    """Deterministic random weights from ``config.seed`` (CPU, in ``config.dtype``)."""
    gen = torch.Generator().manual_seed(config.seed)
    shapes = expected_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        # Uniform with unit (embeddings) or 1/fan_in (linear) variance: as good as
        # normal for a random model, and several times faster to draw on a CPU.
        if name.endswith("norm.weight"):
            w = torch.ones(shape)
        elif name in ("embed.weight", "pos.weight"):
            w = torch.empty(shape).uniform_(-math.sqrt(3), math.sqrt(3), generator=gen)
        else:  # Linear: [out, in]
            bound = math.sqrt(3 / shape[1])
            w = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        weights[name] = w.to(config.torch_dtype).contiguous()
    return weights
