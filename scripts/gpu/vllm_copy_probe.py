#!/usr/bin/env python3
"""Why does the pool -> weights copy run below the pinned limit inside vLLM? Starts a real
vLLM engine on one model, exports and attaches its weights, and asks the worker's
spswap_copy_probe. GPU machine, with the vLLM kit on PYTHONPATH:

    python3 scripts/gpu/vllm_copy_probe.py /tmp/spswap-models/qwen2-0.5b [--first]

--kv-gib N: a KV cache of N GiB (default: what gpu_memory_utilization=0.4 leaves);
--first-only: only the first-copy variants (with --kv-gib: those for a small KV cache).
--variants V,V@WAIT_S,...: only these first-copy variants (e.g. "staged,pull0.2,pull";
implies --first-only): each as the first write after its own sleep, @WAIT_S after a
pause of that many seconds.
--first: also time each way of writing the weights as the first write after a fresh
level-2 sleep + weights wake (with and without a pause first, through new or kept staging
buffers, or pulled by the GPU's cores), then a staged copy right after it: which new
memory makes the copy slow? Ends with a byte-for-byte check of the weights.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from spswap.engines.vllm_engine import VllmEngine, VllmSettings, rank_result
from spswap.pool.store import Pool

FIRST_VARIANTS = [("pull", 0.0), ("staged", 0.0), ("pull0.7", 0.0), ("pull0.5", 0.0),
                  ("pull0.3", 0.0), ("direct", 0.0), ("pull0.7", 0.5)]  # fmt: skip
# With a small KV cache the driver has little to clear after the sleep (sleep_probe.py):
# which way of copying is fastest then?
SMALL_KV_VARIANTS = [("staged", 0.0), ("direct", 0.0), ("staged-kept", 0.0), ("pull", 0.0),
                     ("staged", 0.0), ("direct", 0.0)]  # fmt: skip


def first_touch(eng: VllmEngine, pool: Pool, variants: list[tuple[str, float]]) -> None:
    """Each variant as the first write after a fresh level-2 sleep and weights wake."""
    llm = eng.llm
    llm.collective_rpc("spswap_keep_staging")
    for variant, wait_s in variants:
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        res = rank_result(llm.collective_rpc("spswap_first_copy", args=(variant, wait_s)),
                          "spswap_first_copy", 1)  # fmt: skip
        second = rank_result(llm.collective_rpc("spswap_first_copy", args=("staged", 0.0)),
                             "spswap_first_copy", 1)  # fmt: skip
        print("FIRST", json.dumps({**res, "then_staged_gb_per_s": second["gb_per_s"]}),
              flush=True)  # fmt: skip
        llm.wake_up(tags=["kv_cache"])
    args = (str(pool.pool_dir), eng._attached["digest"])  # every byte as in the pool?
    print("VERIFY", json.dumps(rank_result(llm.collective_rpc("spswap_verify", args=args),
                                           "spswap_verify", 1)), flush=True)  # fmt: skip


KNOWN = ("direct", "direct-touched", "staged", "staged-kept", "memset", "pull")


def given_variants(argv: list[str]) -> list[tuple[str, float]] | None:
    """``--variants``'s list, checked before any engine starts; None when not given."""
    if "--variants" not in argv:
        return None
    at = argv.index("--variants") + 1
    if at >= len(argv) or not argv[at]:
        sys.exit("--variants needs a list, e.g. staged,pull0.2,direct@0.15")
    out = []
    for word in argv[at].split(","):
        name, _, wait = word.partition("@")
        try:
            wait_s = float(wait) if wait else 0.0
            share_ok = name == "pull" or not name.startswith("pull") or 0 < float(name[4:]) <= 1
        except ValueError:
            sys.exit(f"--variants: {word!r} is not NAME or NAME@SECONDS")
        if not (name in KNOWN or name.startswith("pull")) or not share_ok:
            sys.exit(f"--variants: unknown {name!r}; one of {', '.join(KNOWN)}, pullSHARE")
        out.append((name, wait_s))
    return out


def main() -> None:
    model = Path(sys.argv[1])
    variants_given = given_variants(sys.argv)
    pool = Pool(Path(tempfile.mkdtemp(dir="/dev/shm")) / "pool")
    kv_gib = float(sys.argv[sys.argv.index("--kv-gib") + 1]) if "--kv-gib" in sys.argv else 0
    eng = VllmEngine(model, VllmSettings(kv_cache_memory_bytes=int(kv_gib * (1 << 30)) or None))
    print(json.dumps(eng.start(pool, "probe"), default=str), flush=True)
    size = int(eng.weights_info()["size_bytes"])
    print("PINNED", json.dumps(eng.pinned_copy_limit(size)), flush=True)
    if "--first-only" not in sys.argv and variants_given is None:
        res = rank_result(eng.llm.collective_rpc("spswap_copy_probe"), "spswap_copy_probe", 1)
        print("PROBE", json.dumps(res), flush=True)
        eng.sleep()
        eng.wake()
        res = rank_result(eng.llm.collective_rpc("spswap_copy_probe"), "spswap_copy_probe", 1)
        print("PROBE-after-cycle", json.dumps(res), flush=True)
    if variants_given is not None:
        first_touch(eng, pool, variants_given)
    elif "--first" in sys.argv or "--first-only" in sys.argv:
        first_touch(eng, pool, SMALL_KV_VARIANTS if kv_gib else FIRST_VARIANTS)
    eng.close()


if __name__ == "__main__":
    main()
