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

from spswap.engines import cuda_limits
from spswap.engines.gpu_held import process_gpu_bytes
from spswap.engines.host_heap import release_free_heap
from spswap.engines.vllm_pull import pull_bytes_per_s, pull_share
from spswap.engines.vllm_weights import STAGING_BYTES, host_bytes, weight_tensors
from spswap.engines.vllm_worker_probes import SpswapProbes
from spswap.errors import EngineError
from spswap.pool.manifest import Manifest, align_up
from spswap.pool.store import Pool
from spswap.transfer.copy import copy_into
from spswap.transfer.dtypes import to_safetensors
from spswap.transfer.mapping import MappedEntry


class SpswapWorkerExtension(SpswapProbes):
    """Mixed into vLLM's worker (``worker_extension_cls``); see the module docstring.

    State lives on the worker as ``_spswap_*`` attributes created lazily, so nothing
    here runs in ``__init__`` (vLLM does not call it for extensions).
    """

    # Annotations only (no class attributes): nothing here can clash with the worker.
    _spswap_mapping: MappedEntry | None
    _spswap_exit_stack: contextlib.ExitStack
    _spswap_weights: tuple[torch.nn.Module, dict[str, torch.Tensor]] | None
    _spswap_pull_rate: float | None
    _spswap_stack_to_restore: int | None
    # (entry digest, model, block): the weights as packed by spswap_pack
    _spswap_packed: tuple[str, torch.nn.Module, torch.Tensor] | None

    # -- helpers (underscore + prefix: not meant for collective_rpc) --------------------
    def _spswap_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined,no-any-return]

    def _spswap_rank(self) -> tuple[int, int]:
        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        rank = int(getattr(self, "rank", 0))
        return rank, int(pc.tensor_parallel_size)

    def _spswap_tensors(self) -> dict[str, torch.Tensor]:
        """:func:`weight_tensors` of the model, looked up once per model: a level-2 sleep
        and its wake keep every weight's tensor and address (vLLM maps the memory back
        where it was: its CUDA graphs point there), so a wake's copy reuses them (the
        walk of the model's parameters and state dict cost a cycle 3-6 ms on the GPU)."""
        model = self._spswap_model()
        cached = getattr(self, "_spswap_weights", None)
        if cached is None or cached[0] is not model:
            cached = (model, weight_tensors(model))
            self._spswap_weights = cached
        return cached[1]

    def _spswap_pull_bytes_per_s(self) -> float:
        """This GPU's pull rate (:func:`pull_bytes_per_s` of its name), looked up once."""
        rate = getattr(self, "_spswap_pull_rate", None)
        if rate is None:
            # (a CPU worker, the tests' stand-in server, has no GPU to name)
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
            rate = self._spswap_pull_rate = pull_bytes_per_s(gpu)
        return rate

    def _spswap_no_cuda_graphs(self) -> bool:
        """Whether this engine runs without CUDA graphs (eager): only then may a trim drop
        cuBLAS's workspaces (32 MiB of a sleeping 0.5B's 962 on an H100; 92 compiled),
        since captured graphs point into them (a replay after dropping them failed with
        an illegal memory access). Unknown counts as graphs."""
        config = getattr(self, "vllm_config", None)
        mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
        return getattr(mode, "name", None) == "NONE"

    def _spswap_lower_thread_stack(self) -> int | None:
        """Asleep, before a CUDA checkpoint: the context's per-thread stack down to
        :data:`~spswap.engines.cuda_limits.TRIMMED_STACK_BYTES`, which frees its local
        memory (264 MiB on an H100); returns the size it had, kept for
        :meth:`_spswap_restore_thread_stack`, or None where nothing changed."""
        before = cuda_limits.stack_bytes()
        if before is None or before <= cuda_limits.TRIMMED_STACK_BYTES:
            return None
        if not cuda_limits.set_stack_bytes(cuda_limits.TRIMMED_STACK_BYTES):
            return None
        # a second trim (a launch grew the stack in between) keeps the first size
        if getattr(self, "_spswap_stack_to_restore", None) is None:
            self._spswap_stack_to_restore = before
        return before

    def _spswap_restore_thread_stack(self) -> int | None:
        """Before the engine's next kernel (a wake's copy): the per-thread stack a trim
        lowered back to its size, so the engine runs in the context it was measured
        in; returns that size, or None where no trim lowered it."""
        size = getattr(self, "_spswap_stack_to_restore", None)
        if size is None:
            return None
        self._spswap_stack_to_restore = None
        # a refusal costs nothing but a first launch that grows the stack itself
        return size if cuda_limits.set_stack_bytes(size) else None

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
                raw = host_bytes(t)
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

            tensors = self._spswap_tensors()
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
        ``pull``: the share the GPU's cores pull themselves before the copy engines
        copy the rest; None: chosen by
        :func:`~spswap.engines.vllm_pull.pull_share` from ``since_sleep_s`` (seconds
        since this process's level-2 sleep; None: it never slept), the bytes that
        sleep handed back to the driver, the copy's own size and this GPU's pull rate.
        ``worker_s``: the call's whole time in the worker: ``prepare_s`` (choosing the
        pull, looking up the weights) then ``copy_call_s`` (the copy's ``seconds`` plus
        its checks and streams), so a cycle's time outside the copy can be placed."""
        entered = time.perf_counter()
        stack_restored = self._spswap_restore_thread_stack()
        mapping: MappedEntry | None = getattr(self, "_spswap_mapping", None)
        if mapping is None:
            raise EngineError(
                "no pool entry is attached to this vLLM worker; call spswap_attach (or "
                "VllmEngine.load_from_pool) first"
            )
        released = None
        if pull is None:
            released = self._spswap_sleep_pool_bytes() if since_sleep_s is not None else None
            rate = self._spswap_pull_bytes_per_s()
            pull = pull_share(since_sleep_s, released, mapping.size_bytes, rate)
        tensors = self._spswap_tensors()
        packed = getattr(self, "_spswap_packed", None)
        same = packed and packed[0] == mapping.manifest.digest and packed[1] is self._spswap_model()
        block = packed[2] if packed and same else None
        called = time.perf_counter()
        report = copy_into(mapping, tensors, staging_bytes=STAGING_BYTES, pull=pull,
                           packed_into=block)  # fmt: skip
        done = time.perf_counter()
        return {**report.to_json(), "pull": pull, "released_bytes": released,
                "packed": block is not None,
                "worker_s": done - entered, "prepare_s": called - entered,
                "copy_call_s": done - called,
                "stack_restored_bytes": stack_restored}  # fmt: skip

    def spswap_pack(self, slot_share: float | None = None,
                    max_bytes: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Move the weights into one allocation of vLLM's sleep-mode pool, laid out as the
        attached entry's data file (:mod:`spswap.engines.vllm_pack`): a level-2 sleep
        then unmaps, and a wake maps, one allocation for them, and :meth:`spswap_copy`
        copies the entry in one host copy. Awake, eager engines only, where the GPU has
        room for the weights twice for a moment (``slot_share``: the share of the GPU's
        memory the run's slot holds, of which the engine may not take more; the second
        copy must fit beside what it holds now; ``max_bytes``: larger weights stay as
        loaded); returns what it did (``packed``, else ``why`` not), the room it judged and
        vLLM's allocations by tag before and after."""
        mapping: MappedEntry | None = getattr(self, "_spswap_mapping", None)
        if mapping is None:
            raise EngineError("attach a pool entry first (spswap_attach): packing follows "
                              "its layout")  # fmt: skip
        if any(t.device.type != "cuda" for t in self._spswap_tensors().values()):
            return {"packed": False, "why": "the weights are not on a CUDA GPU"}
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        from spswap.engines.vllm_pack import SlotRoom, pack_weights
        from spswap.transfer.packed import packed_target

        params = dict(self._spswap_tensors())
        self._spswap_weights = None  # (the lookup's references to the old tensors)
        model = self._spswap_model()
        free_bytes, total_bytes = torch.cuda.mem_get_info()
        room = None
        if slot_share is not None:
            held = process_gpu_bytes(os.getpid())  # (this engine core holds its GPU memory)
            room = SlotRoom(slot_bytes=int(slot_share * total_bytes),
                            held_bytes=held if held is not None else total_bytes - free_bytes,
                            held_by_engine=held is not None)  # fmt: skip
        report, block = pack_weights(
            model, mapping.manifest, params,
            allocator=CuMemAllocator.get_instance(), release=unmap_and_release,
            free_bytes=int(free_bytes), room=room, max_bytes=max_bytes,
            cuda_graphs=not self._spswap_no_cuda_graphs(),
        )  # fmt: skip
        if block is None:
            return report
        # the layout checked once: each later wake copies into the block alone
        found = packed_target(mapping.manifest, self._spswap_tensors())
        report["layout_checked"] = found is not None and found.data_ptr() == block.data_ptr()
        if report["layout_checked"]:
            self._spswap_packed = (mapping.manifest.digest, model, block)
        return report

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
        host memory (:mod:`spswap.engines.host_heap`); the context's per-thread stack
        (:mod:`spswap.engines.cuda_limits`; the next copy sets it back, before any
        kernel); without CUDA graphs, cuBLAS's workspaces too. Returns the
        device's free/total bytes, torch's reserved/allocated, whether cuBLAS's went,
        the stack size lowered (``stack_lowered_from_bytes``) and what the heap release
        did."""
        import gc

        gc.collect()
        if not torch.cuda.is_available():
            return release_free_heap().to_json()
        cublas = self._spswap_no_cuda_graphs()
        if cublas:  # re-made at the next matmul (the check prompt after a restore)
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        # with CUDA graphs too: a compiled engine's stack at 16 bytes through a CUDA
        # checkpoint and restore, set back before its next replay, gave the same answers
        # (H100 2026-12-07; it died where cuBLAS's workspaces had gone as well)
        stack = self._spswap_lower_thread_stack()
        heap = release_free_heap().to_json()  # after the device's: a failure here costs less
        free, total = torch.cuda.mem_get_info()
        return {**heap, "cublas_cleared": cublas, "stack_lowered_from_bytes": stack,
                "free_bytes": int(free), "total_bytes": int(total),
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
            raw = host_bytes(t)
            if "sha256:" + hashlib.sha256(raw.tobytes()).hexdigest() != entry.checksum:
                differ.append(entry.name)
        return {"checked": len(manifest.tensors), "differ": differ}

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
