"""Diagnostics of the pool -> weights copy inside vLLM's worker (for
scripts/gpu/vllm_copy_probe.py and tests/engines/test_vllm.py), mixed into
:class:`spswap.engines.vllm_worker.SpswapWorkerExtension`; not on any serving path."""

from __future__ import annotations

import time
from typing import Any

import torch

from spswap.engines.vllm_weights import STAGING_BYTES, weight_tensors
from spswap.errors import EngineError
from spswap.transfer.copy import copy_into
from spswap.transfer.mapping import MappedEntry


class SpswapProbes:
    """Copy-rate probes, callable as ``collective_rpc("spswap_<name>")``; they read the
    entry :meth:`SpswapWorkerExtension.spswap_attach` attached."""

    _spswap_mapping: MappedEntry | None
    _spswap_kept_staging: list[torch.Tensor]

    def _spswap_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined,no-any-return]

    def spswap_copy_probe(self, repeats: int = 3) -> dict[str, Any]:
        """Diagnose the pool -> weights copy rate (for scripts/gpu/vllm_copy_probe.py): the
        attached entry into the live weights, into fresh tensors of the same shapes, and
        as one flat buffer; plus where the weights' memory comes from."""
        mapping: MappedEntry | None = getattr(self, "_spswap_mapping", None)
        if mapping is None:
            raise EngineError("attach a pool entry first (spswap_attach)")
        weights = weight_tensors(self._spswap_model())
        total = sum(t.size_bytes for t in mapping.manifest.tensors)

        def best(fn: Any) -> float:
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return total / min(times) / 1e9

        fresh = {n: torch.empty(t.shape, dtype=t.dtype, device=t.device)
                 for n, t in weights.items()}  # fmt: skip
        flat = torch.empty(mapping.size_bytes, dtype=torch.uint8, device="cuda")
        srcs = mapping.tensors()
        out = {
            "live_gb_s": best(lambda: copy_into(mapping, weights)),
            "live_staged_gb_s": best(
                lambda: copy_into(mapping, weights, staging_bytes=STAGING_BYTES)
            ),
            **{
                f"live_pull{f:g}_gb_s": best(lambda f=f: copy_into(mapping, weights, pull=f))
                for f in (1.0, 0.7, 0.5, 0.3)
            },
            "fresh_gb_s": best(lambda: copy_into(mapping, fresh)),
            "flat_gb_s": best(lambda: flat.copy_(mapping.tensors_base(), non_blocking=True)),
            "src_pinned": [bool(t.is_pinned()) for t in list(srcs.values())[:3]],
            "live_contiguous": all(t.is_contiguous() for t in weights.values()),
            "live_dtypes": sorted({str(t.dtype) for t in weights.values()}),
            "allocator": torch.cuda.get_allocator_backend(),
            "tensors": len(weights),
            "cpu_affinity": sorted(__import__("os").sched_getaffinity(0))[:64],
        }
        sizes = sorted(t.size_bytes for t in mapping.manifest.tensors)
        out["size_median"] = sizes[len(sizes) // 2]
        fresh.clear()
        flat.resize_(0)
        torch.cuda.empty_cache()
        return out

    def spswap_first_copy(self, variant: str, wait_s: float = 0.0) -> dict[str, Any]:
        """One timed copy of the attached entry into the weights, meant as the FIRST write
        after ``wake_up(tags=["weights"])`` (scripts/gpu/vllm_copy_probe.py --first):
        ``direct`` (host -> weights), ``staged`` (what spswap_copy does), ``memset`` (a
        device-side zero of every weight: is the first write slow for the GPU too?), each
        after ``wait_s`` of idling (does the driver prepare the new memory meanwhile?);
        ``staged-kept``: staged through buffers allocated before the sleep and kept over
        it (spswap_keep_staging): is it the staging buffers' new memory that is slow?;
        ``direct-touched``: the weights zeroed on the GPU first (untimed), then direct:
        are copy-engine writes slow into memory the GPU has already written?; ``pull``: the
        GPU's cores read the registered mapping themselves (no copy engine); ``pull0.6``: 60% of
        the bytes so, then the copy engines the rest (a wake's pull-first copy)."""
        mapping: MappedEntry | None = getattr(self, "_spswap_mapping", None)
        if mapping is None:
            raise EngineError("attach a pool entry first (spswap_attach)")
        weights = weight_tensors(self._spswap_model())
        cuda = any(t.is_cuda for t in weights.values())
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        time.sleep(wait_s)
        sync()
        t0 = time.perf_counter()
        if variant == "direct":
            copy_into(mapping, weights)
        elif variant == "direct-touched":
            for t in weights.values():
                t.zero_()
            sync()
            t0 = time.perf_counter()
            copy_into(mapping, weights)
        elif variant == "staged-kept":
            kept = getattr(self, "_spswap_kept_staging", None)
            if kept is None:
                raise EngineError("staged-kept needs spswap_keep_staging called first")
            copy_into(mapping, weights, staging_bytes=STAGING_BYTES, staging_buffers=kept)
        elif variant == "staged":
            copy_into(mapping, weights, staging_bytes=STAGING_BYTES)
        elif variant.startswith("pull"):  # "pull": all pulled; "pull0.6": 60%, rest CE
            copy_into(mapping, weights, pull=float(variant[4:] or 1),
                      staging_bytes=STAGING_BYTES)  # fmt: skip
        elif variant == "memset":
            for t in weights.values():
                t.zero_()
        else:
            raise EngineError(
                f"unknown variant {variant!r}: direct, direct-touched, staged, "
                "staged-kept, pull or memset"
            )
        sync()
        seconds = time.perf_counter() - t0
        size = sum(t.size_bytes for t in mapping.manifest.tensors)
        return {"variant": variant, "wait_s": wait_s, "seconds": seconds,
                "gb_per_s": size / seconds / 1e9}  # fmt: skip

    def spswap_keep_staging(self) -> dict[str, Any]:
        """Allocate two staging buffers and keep them (over sleeps) for ``staged-kept``."""
        self._spswap_kept_staging = [torch.empty(STAGING_BYTES, dtype=torch.uint8,
                                                 device="cuda") for _ in range(2)]  # fmt: skip
        torch.cuda.synchronize()
        return {"bytes": 2 * STAGING_BYTES}
