"""spswap's vLLM worker extension: pool export, pool load and wake-time copies, inside
vLLM's own worker process.

vLLM mixes the class named by ``worker_extension_cls`` into its GPU worker; each public
method here is then callable from the engine's owner as
``llm.collective_rpc("spswap_<method>", args=(...))``. Methods take and return plain
data (str, int, float, dict, list): results cross vLLM's msgpack channel, so no
``VLLM_ALLOW_INSECURE_SERIALIZATION`` is needed.

Every attribute is prefixed ``spswap_`` because vLLM refuses an extension whose names
clash with the worker's. The weights are the tensors vLLM holds after loading
(``model_runner.model``: fused qkv / gate_up, tied embeddings once) plus persistent
buffers, so a copy back needs no weight loader and no post-processing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch

from spswap.engines.host_heap import release_free_heap
from spswap.engines.vllm_pull import pull_bytes_per_s, pull_share
from spswap.errors import EngineError
from spswap.pool.manifest import Manifest, align_up
from spswap.pool.store import Pool
from spswap.transfer.copy import copy_into
from spswap.transfer.dtypes import to_safetensors
from spswap.transfer.mapping import MappedEntry

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


def _host_bytes(t: torch.Tensor) -> Any:
    """A tensor's bytes on the host as a flat uint8 numpy array (0-dim tensors too:
    vLLM holds scalar parameters such as attention scales)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


class SpswapWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); see the module docstring.

    State lives on the worker as ``_spswap_*`` attributes created lazily, so nothing
    here runs in ``__init__`` (vLLM does not call it for extensions).
    """

    # Annotations only (no class attributes): nothing here can clash with the worker.
    _spswap_mapping: MappedEntry | None
    _spswap_exit_stack: contextlib.ExitStack

    # -- helpers (underscore + prefix: not meant for collective_rpc) --------------------
    def _spswap_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined,no-any-return]

    def _spswap_rank(self) -> tuple[int, int]:
        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        rank = int(getattr(self, "rank", 0))
        return rank, int(pc.tensor_parallel_size)

    def _spswap_stack(self) -> contextlib.ExitStack:
        stack = getattr(self, "_spswap_exit_stack", None)
        if stack is None:
            stack = contextlib.ExitStack()
            self._spswap_exit_stack = stack
        return stack

    # -- callable through collective_rpc ------------------------------------------------
    def spswap_weights_info(self) -> dict[str, Any]:
        """Bytes, tensor count, dtypes and rank of the weights this worker holds."""
        tensors = weight_tensors(self._spswap_model())
        rank, tp = self._spswap_rank()
        return {
            "rank": rank, "tp_size": tp, "tensors": len(tensors),
            "size_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "dtypes": sorted({str(t.dtype) for t in tensors.values()}),
            "mapped": getattr(self, "_spswap_mapping", None) is not None,
        }  # fmt: skip

    @torch.inference_mode()
    def spswap_export(self, pool_dir: str, name: str, identity: dict[str, Any]) -> dict[str, Any]:
        """Write this worker's weights as pool entry ``name`` with ``identity`` (plus this
        worker's rank and tp_size); returns the manifest's name, digest and sizes."""
        tensors = weight_tensors(self._spswap_model())
        rank, tp = self._spswap_rank()
        identity = {**identity, "rank": rank, "tp_size": tp}
        total = sum(align_up(t.numel() * t.element_size()) for t in tensors.values())
        pool = Pool(Path(pool_dir))
        start = time.perf_counter()
        with pool.writer(name, identity=identity, expected_size_bytes=total) as w:
            for tname in sorted(tensors):
                t = tensors[tname]
                raw = _host_bytes(t)
                w.add(tname, to_safetensors(t.dtype), tuple(t.shape), raw)
        m = w.manifest
        assert m is not None  # set when the writer closes without an error
        return {
            "name": m.name, "digest": m.digest, "size_bytes": m.data_size_bytes,
            "tensors": len(m.tensors), "seconds": time.perf_counter() - start,
            "reused": w.reused, "identity": m.identity,
        }  # fmt: skip

    @torch.inference_mode()
    def spswap_export_file(self, path: str) -> dict[str, Any]:
        """Write this worker's weights as one safetensors file at ``path`` (mode 0600), for
        a user's import through spswapd (a user cannot write the pool itself); returns
        the path, bytes and tensor count. The caller deletes the file after the import."""
        from safetensors.torch import save_file

        tensors = weight_tensors(self._spswap_model())
        host = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        save_file(host, path)
        return {
            "path": path,
            "tensors": len(host),
            "size_bytes": sum(t.numel() * t.element_size() for t in host.values()),
        }

    def spswap_attach(self, pool_dir: str, ref: str, hold: bool = True) -> dict[str, Any]:
        """Map pool entry ``ref`` read-only, mark it in use by this worker (``hold``; a
        user's worker cannot write the pool: its owner holds the use through spswapd)
        and register it with CUDA (once): later :meth:`spswap_copy` calls reuse the
        mapping."""
        self.spswap_detach()
        pool = Pool(Path(pool_dir))
        stack = contextlib.ExitStack()
        try:
            manifest: Manifest = stack.enter_context(pool.use(ref)) if hold else pool.find(ref)
            mapping = MappedEntry(manifest, pool.data_path(manifest))
            stack.callback(mapping.close)
            from spswap.transfer.copy import check_compatible

            tensors = weight_tensors(self._spswap_model())
            check_compatible(manifest, tensors)
            on_cuda = any(t.is_cuda for t in tensors.values())
            register_s = mapping.register_cuda() if on_cuda else 0.0
        except BaseException:
            stack.close()
            raise
        self._spswap_exit_stack = stack
        self._spswap_mapping = mapping
        return {
            "name": manifest.name, "digest": manifest.digest,
            "size_bytes": manifest.data_size_bytes, "tensors": len(manifest.tensors),
            "register_s": register_s, "registered": mapping.registered,
        }  # fmt: skip

    def spswap_copy(
        self, pull: float | None = None, since_sleep_s: float | None = None
    ) -> dict[str, Any]:
        """Copy the attached entry into the weights (async copies on a dedicated stream);
        returns the TransferReport as a dict, with the ``pull`` share used and the
        ``released_bytes`` it was chosen for. Call after ``wake_up(tags=["weights"])``.
        ``pull``: the share the GPU's cores pull themselves; None: chosen by
        :func:`~spswap.engines.vllm_pull.pull_share` from ``since_sleep_s`` (seconds
        since this process's level-2 sleep; None: it never slept), the bytes that
        sleep handed back to the driver, the copy's own size and this GPU's pull rate.
        ``worker_s``: the call's whole time in the worker (the copy's ``seconds`` plus
        looking up the weights and checking the entry)."""
        entered = time.perf_counter()
        mapping: MappedEntry | None = getattr(self, "_spswap_mapping", None)
        if mapping is None:
            raise EngineError(
                "no pool entry is attached to this vLLM worker; call spswap_attach (or "
                "VllmEngine.load_from_pool) first"
            )
        released = None
        if pull is None:
            released = self._spswap_sleep_pool_bytes() if since_sleep_s is not None else None
            # (a CPU worker, the tests' stand-in server, has no GPU to name)
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
            rate = pull_bytes_per_s(gpu)
            pull = pull_share(since_sleep_s, released, mapping.size_bytes, rate)
        report = copy_into(mapping, weight_tensors(self._spswap_model()),
                           staging_bytes=STAGING_BYTES, pull=pull)  # fmt: skip
        return {**report.to_json(), "pull": pull, "released_bytes": released,
                "worker_s": time.perf_counter() - entered}  # fmt: skip

    def _spswap_sleep_pool_bytes(self) -> int | None:
        """Bytes in vLLM's sleep-mode pool (weights and KV cache): what a level-2 sleep
        hands back to the driver. None where this vLLM does not say (its allocator's
        bookkeeping is not public API: then :func:`pull_share` falls back to a window)."""
        try:
            from vllm.device_allocator.cumem import CuMemAllocator

            data = CuMemAllocator.get_instance().pointer_to_data.values()
            return sum(int(d.handle[1]) for d in data)  # handle: (device, size, ptr, ...)
        except Exception:
            return None

    def spswap_load(self, pool_dir: str, ref: str, hold: bool = True) -> dict[str, Any]:
        """:meth:`spswap_attach` then :meth:`spswap_copy`; returns both reports."""
        attach = self.spswap_attach(pool_dir, ref, hold)
        return {"attach": attach, "copy": self.spswap_copy()}

    def spswap_trim(self) -> dict[str, Any]:
        """Before a CUDA checkpoint (after a level-2 sleep): hand the caching allocator's
        free blocks back to the driver, so only live memory is checkpointed (it moves at
        ~2 GB/s), and the heap's freed pages back to the kernel, so CRIU dumps only live
        host memory (:mod:`spswap.engines.host_heap`). Returns the device's free/total
        bytes, torch's reserved/allocated and what the heap release did."""
        import gc

        gc.collect()
        if not torch.cuda.is_available():
            return release_free_heap().to_json()
        torch.cuda.empty_cache()
        heap = release_free_heap().to_json()  # after the device's: a failure here costs less
        free, total = torch.cuda.mem_get_info()
        return {**heap, "free_bytes": int(free), "total_bytes": int(total),
                "torch_reserved_bytes": int(torch.cuda.memory_reserved()),
                "torch_allocated_bytes": int(torch.cuda.memory_allocated())}  # fmt: skip

    def spswap_detach(self) -> dict[str, Any]:
        """Unregister and unmap the attached entry and drop this worker's use of it."""
        had = getattr(self, "_spswap_mapping", None) is not None
        self._spswap_mapping = None
        self._spswap_stack().close()
        self._spswap_exit_stack = contextlib.ExitStack()
        return {"detached": had}

    @torch.inference_mode()
    def spswap_verify(self, pool_dir: str, ref: str) -> dict[str, Any]:
        """Hash every weight on the device against entry ``ref``'s checksums (slow: reads
        everything back; for tests). Returns the names that differ."""
        pool = Pool(Path(pool_dir))
        manifest = pool.find(ref)
        tensors = weight_tensors(self._spswap_model())
        differ = []
        for entry in manifest.tensors:
            t = tensors.get(entry.name)
            if t is None:
                differ.append(entry.name)
                continue
            raw = _host_bytes(t)
            if "sha256:" + hashlib.sha256(raw.tobytes()).hexdigest() != entry.checksum:
                differ.append(entry.name)
        return {"checked": len(manifest.tensors), "differ": differ}

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
        the bytes so, the rest by the copy engines at the same time."""
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
            copy_into(mapping, weights, pull=float(variant[4:] or 1))
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

    def spswap_pinned_copy_limit(self, size_bytes: int, repeats: int = 5) -> dict[str, Any]:
        """Host->GPU copy rate from a ``cudaHostAlloc`` (pinned) buffer of ``size_bytes``
        in this process: the ceiling a pool copy is measured against. Best of ``repeats``."""
        src = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
        src.fill_(1)
        dst = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            times.append(time.perf_counter() - start)
        del dst, src
        torch.cuda.empty_cache()
        best = min(times)
        return {"size_bytes": size_bytes, "best_s": best, "times_s": times,
                "gb_per_s": size_bytes / best / 1e9}  # fmt: skip
