"""The weights a vLLM worker holds, as spswap's pool sees them, and how they cross PCIe
(shared by the worker extension, its probes and the overlapped wake)."""

from __future__ import annotations

from typing import Any

import torch

# Host copies go through two device staging buffers of this size: one large copy per
# piece keeps the copy engines at full rate where hundreds of small per-tensor copies would
# not, and the scatter into the weights runs while the next piece crosses PCIe. At wake
# time the KV cache is still asleep, so 256 MiB of staging is free memory; 128 MiB pieces
# cross PCIe in ~2.5 ms. (Slow first copies after a sleep, once blamed on the re-mapped
# weight memory, were the driver clearing the freed KV cache: see pull_share.)
STAGING_BYTES = 128 << 20


def weight_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a pool entry holds for ``model``: its parameters (tied ones once) and
    its persistent buffers, by name, each storage range once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    persistent = set(model.state_dict(keep_vars=True).keys())
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    named += [(n, b) for n, b in model.named_buffers() if n in persistent]
    for name, t in named:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.data if isinstance(t, torch.nn.Parameter) else t
    return out


def host_bytes(t: torch.Tensor) -> Any:
    """A tensor's bytes on the host as a flat uint8 numpy array (0-dim tensors too:
    vLLM holds scalar parameters such as attention scales)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
