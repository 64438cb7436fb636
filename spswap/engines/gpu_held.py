"""What one process holds on the GPUs, by NVML's account (the driver's own figure: the
CUDA context, the caching allocator's segments and vLLM's sleep-mode pools alike), for
the packing's room check (:class:`spswap.engines.vllm_pack.SlotRoom`)."""

from __future__ import annotations


def process_gpu_bytes(pid: int) -> int | None:
    """The GPU memory NVML lists for process ``pid``, summed over every GPU; None where
    pynvml or the driver is absent or fails, or NVML does not list ``pid`` (a process in
    another pid namespace than the driver's, as in some containers, is listed under
    another number)."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: no figure
        return None
    try:
        found, total = False, 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if int(proc.pid) == pid and isinstance(proc.usedGpuMemory, int):
                    found, total = True, total + int(proc.usedGpuMemory)
        return total if found else None
    except Exception:  # noqa: BLE001 - an NVML error: no figure
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - nothing to do about a failed shutdown
            pass
