#!/usr/bin/env python3
"""Why does the pool -> weights copy run below the pinned limit inside vLLM? Starts a real
vLLM engine on one model, exports and attaches its weights, and asks the worker's
spswap_copy_probe. GPU machine, with the vLLM kit on PYTHONPATH:

    python3 scripts/gpu/vllm_copy_probe.py /tmp/spswap-models/qwen2-0.5b
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from spswap.engines.vllm_engine import VllmEngine, rank_result
from spswap.pool.store import Pool


def main() -> None:
    model = Path(sys.argv[1])
    pool = Pool(Path(tempfile.mkdtemp(dir="/dev/shm")) / "pool")
    eng = VllmEngine(model)
    print(json.dumps(eng.start(pool, "probe"), default=str), flush=True)
    res = rank_result(eng.llm.collective_rpc("spswap_copy_probe"), "spswap_copy_probe", 1)
    print("PROBE", json.dumps(res), flush=True)
    eng.sleep()
    eng.wake()
    res = rank_result(eng.llm.collective_rpc("spswap_copy_probe"), "spswap_copy_probe", 1)
    print("PROBE-after-cycle", json.dumps(res), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
