#!/usr/bin/env python3
"""Write Qwen2-style model directories with REAL random safetensors weights (no hub).

    python3 scripts/gpu/make_models.py --out /tmp/spswap-models --sizes 0.5b 1.5b [7b]

Each directory gets config.json, generation_config.json and model*.safetensors (sharded
at --shard-gib, with model.safetensors.index.json) in bf16, deterministic from --seed
(one generator per tensor), no tokenizer: load with ``skip_tokenizer_init=True`` and
token-id prompts. The shapes are Qwen2's 0.5B / 1.5B / 7B. Runs on a GPU machine (the
tensors are drawn there, fast) or on CPU (slow for 7B). After writing, the files are
dropped from the page cache so a first load reads the disk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False),
}  # fmt: skip
INIT_STD = 0.02


def qwen2_config(size: str, max_position_embeddings: int = 32768) -> dict[str, Any]:
    """A Qwen2ForCausalLM config.json for one of :data:`SHAPES`."""
    if size not in SHAPES:
        raise SystemExit(f"unknown size {size!r}; choose from {', '.join(SHAPES)}")
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_dropout": 0.0,
        "initializer_range": INIT_STD, "use_cache": True, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": SHAPES[size]["num_hidden_layers"],
        "max_position_embeddings": max_position_embeddings, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "bfloat16", **SHAPES[size],
    }  # fmt: skip


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of a Qwen2 config, HF names, in file order."""
    h, i = config["hidden_size"], config["intermediate_size"]
    head = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }  # fmt: skip
    out["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = (config["vocab_size"], h)
    return out


def shard_plan(shapes: dict[str, tuple[int, ...]], shard_bytes: int,
               elem_bytes: int = 2) -> list[list[str]]:  # fmt: skip
    """Tensor names grouped into shards of at most ``shard_bytes`` (one tensor may
    exceed it alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * elem_bytes
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_model(out_dir: Path, size: str, *, seed: int, shard_bytes: int) -> dict[str, Any]:
    """Write one model directory; returns what was written."""
    import torch
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = qwen2_config(size)
    d = out_dir / f"qwen2-{size}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (d / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}) + "\n"
    )
    shapes = tensor_shapes(config)
    shards = shard_plan(shapes, shard_bytes)
    n = len(shards)
    files = (["model.safetensors"] if n == 1
             else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)])  # fmt: skip
    start = time.perf_counter()
    weight_map: dict[str, str] = {}
    total = 0
    index = 0
    for names, fname in zip(shards, files, strict=True):
        tensors = {}
        for name in names:
            g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
            index += 1
            if name.endswith("norm.weight"):
                t = torch.ones(shapes[name], dtype=torch.bfloat16, device=device)
            else:
                t = torch.empty(shapes[name], dtype=torch.float32, device=device)
                t.normal_(0.0, INIT_STD, generator=g)
                t = t.to(torch.bfloat16)
            tensors[name] = t.cpu()
            total += t.numel() * 2
            weight_map[name] = fname
        save_file(tensors, str(d / fname), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (d / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1) + "\n")
    for f in files:
        fd = os.open(d / f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return {"dir": str(d), "size": size, "bytes": total, "files": files,
            "params": total // 2, "seconds": time.perf_counter() - start}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/spswap-models"))
    ap.add_argument("--sizes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gib", type=float, default=4.0)
    args = ap.parse_args(argv)  # fmt: skip
    for size in args.sizes:
        info = write_model(args.out, size, seed=args.seed,
                           shard_bytes=int(args.shard_gib * (1 << 30)))  # fmt: skip
        print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
