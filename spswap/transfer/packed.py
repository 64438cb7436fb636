"""Weights packed as their pool entry's data file: every tensor a view of one block of
device memory at its tensor's offset in ``data.bin``. Then a whole entry moves in one
host copy, and the engine's sleep-mode allocator maps and unmaps one allocation for the
weights instead of one per segment (each call costs ~40-50 us whatever its size:
docs/notes/copy-after-sleep.md). Pure torch: no CUDA call, no engine.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from spswap.pool.manifest import Manifest

Key = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]  # see tensor_key


def packed_target(manifest: Manifest, params: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The uint8 block the tensors of ``params`` are packed in, as long as the entry's
    data file (``manifest.data_size_bytes``), when every tensor of the entry is a
    contiguous view of one storage at exactly its offset in the entry (see
    :func:`pack_into`); None otherwise (the tensors are apart: copy them one by one)."""
    entries = manifest.tensors
    if not entries or any(e.name not in params for e in entries):
        return None
    first = params[entries[0].name]
    storage = first.untyped_storage()
    base = first.data_ptr() - entries[0].offset
    start = base - storage.data_ptr()
    if start < 0 or start + manifest.data_size_bytes > storage.nbytes():
        return None
    for e in entries:
        t = params[e.name]
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.data_ptr() - base != e.offset
                or t.numel() * t.element_size() != e.size_bytes):  # fmt: skip
            return None
    whole = torch.empty(0, dtype=torch.uint8, device=first.device)
    return whole.set_(storage, start, (manifest.data_size_bytes,), (1,))


def views_of(manifest: Manifest, params: Mapping[str, torch.Tensor],
             block: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """Each tensor of ``params`` as a view of the uint8 ``block`` (as long as the entry's
    data file) at its offset in the entry, with its dtype and shape; the bytes are not
    copied."""
    out: dict[str, torch.Tensor] = {}
    for e in manifest.tensors:
        t = params[e.name]
        out[e.name] = block[e.offset : e.offset + e.size_bytes].view(t.dtype).view(t.shape)
    return out


def tensor_key(t: torch.Tensor) -> Key:
    """What makes two tensors the same weight: the same memory seen the same way."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def rebind(model: torch.nn.Module, replacements: Mapping[Key, torch.Tensor]) -> int:
    """Point every parameter and buffer of ``model`` whose :func:`tensor_key` is in
    ``replacements`` at its replacement (a parameter keeps its object: ``param.data``;
    a buffer is replaced in its module), so that the module reads the new memory and
    holds the old no more. Tied weights (one object in two modules, or two objects over
    the same memory) all follow. Returns how many were pointed anew."""
    rebound = 0
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and tensor_key(param) in replacements:
                param.data = replacements[tensor_key(param)]
                rebound += 1
        for name, buf in list(module._buffers.items()):
            if buf is not None and tensor_key(buf) in replacements:
                module._buffers[name] = replacements[tensor_key(buf)]
                rebound += 1
    return rebound


def pack_into(model: torch.nn.Module, manifest: Manifest, params: Mapping[str, torch.Tensor],
              block: torch.Tensor) -> int:  # fmt: skip
    """Copy each tensor of ``params`` (the entry's names: parameters and persistent
    buffers of ``model``) into the uint8 ``block`` at its offset in the entry, then
    :func:`rebind` the model to those views; returns how many were pointed anew.
    Afterwards :func:`packed_target` of the model's tensors is ``block``. The caller
    drops its own references to the old tensors (their memory goes back only then)."""
    views = views_of(manifest, params, block)
    replacements: dict[Key, torch.Tensor] = {}
    with torch.no_grad():
        for name, view in views.items():
            view.copy_(params[name])
            replacements[tensor_key(params[name])] = view
    return rebind(model, replacements)
