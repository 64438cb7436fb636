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


def _set_param(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter ``name`` (dotted) of ``module`` by ``tensor``, whatever the old
    one's device (a model built on ``meta`` gets its first real weights this way)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, leaf, torch.nn.Parameter(tensor, requires_grad=False))


def bind_views(mapping: MappedEntry, module: torch.nn.Module, *,
               since_s: float | None = None) -> TransferReport:  # fmt: skip
    """Make every parameter of ``module`` the same-named tensor of ``mapping`` (CPU
    views, no copy); names, shapes and dtypes are checked first (a mismatch changes
    nothing). ``module`` may be built on ``meta`` (nothing allocated that the binding
    would throw away). ``since_s``: a ``time.perf_counter()`` taken before the mapping
    was made, so that the report's time counts the mapping's populate as well (what the
    start really paid)."""
    params = dict(module.named_parameters())
    check_compatible(mapping.manifest, params)
    for p in params.values():
        if p.device.type not in ("cpu", "meta"):
            raise ValueError(f"bind_views binds CPU parameters, not {p.device}: copy "
                             "instead (spswap.transfer.copy.copy_into)")  # fmt: skip
    start = time.perf_counter() if since_s is None else since_s
    views = mapping.tensors()
    for name in params:
        _set_param(module, name, views[name])
    return TransferReport(
        size_bytes=sum(t.size_bytes for t in mapping.manifest.tensors),
        seconds=time.perf_counter() - start, device="cpu", tensors=len(views),
        registered=False, mapped=True,
    )  # fmt: skip


def unbind(module: torch.nn.Module) -> None:
    """Drop every parameter's binding (a sleep): each becomes one element of its dtype seen
    in its shape (stride 0), so nothing of the mapping is referenced through the module any
    more while :func:`bind_views` can still check the shapes at the wake."""
    for name, p in list(module.named_parameters()):
        _set_param(module, name, torch.zeros(1, dtype=p.dtype).expand(p.shape))
