"""Weights that are the pool's own pages: a CPU engine's parameters bound to the views of a
mapped pool entry, no copy.

On the CPU the pool's tmpfs pages are already in the memory the engine computes from, so a
copy only costs: new tensors fault their pages in as the copy writes them (0.5-2 GB/s on
the 2-core CI machine, against 15.7 GB/s for mapping the same bytes with
``MAP_POPULATE``), and it doubles the memory a served model holds. Bound parameters are
read-only (the mapping is): the engine computes under ``torch.inference_mode`` and never
writes a weight; loading other weights builds a new model. The mapping must stay open while
the parameters are bound (the engine keeps it for its life, as it does to copy back at a
wake).
"""

from __future__ import annotations

import time

import torch

from spswap.transfer.copy import TransferReport, check_compatible
from spswap.transfer.mapping import MappedEntry


def bind_views(mapping: MappedEntry, module: torch.nn.Module, *,
               since_s: float | None = None) -> TransferReport:  # fmt: skip
    """Point every parameter of ``module`` (on the CPU) at the same-named tensor of
    ``mapping``; names, shapes and dtypes are checked first (a mismatch changes nothing).
    ``since_s``: a ``time.perf_counter()`` taken before the mapping was made, so that the
    report's time counts the mapping's populate as well (what the start really paid)."""
    params = dict(module.named_parameters())
    check_compatible(mapping.manifest, params)
    for p in params.values():
        if p.device.type != "cpu":
            raise ValueError(f"bind_views binds CPU parameters, not {p.device}: copy "
                             "instead (spswap.transfer.copy.copy_into)")  # fmt: skip
    start = time.perf_counter() if since_s is None else since_s
    views = mapping.tensors()
    with torch.no_grad():
        for name, p in params.items():
            p.data = views[name]
    return TransferReport(
        size_bytes=sum(t.size_bytes for t in mapping.manifest.tensors),
        seconds=time.perf_counter() - start, device="cpu", tensors=len(views),
        registered=False, mapped=True,
    )  # fmt: skip


def unbind(module: torch.nn.Module) -> None:
    """Drop every parameter's binding (a sleep): each becomes one element of its dtype seen
    in its shape (stride 0), so nothing of the mapping is referenced through the module any
    more while :func:`bind_views` can still check the shapes at the wake."""
    with torch.no_grad():
        for p in module.parameters():
            p.data = torch.zeros(1, dtype=p.dtype).expand(p.shape)
