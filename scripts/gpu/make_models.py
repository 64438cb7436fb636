#!/usr/bin/env python3
"""Write Qwen2-style model directories with REAL random safetensors weights (no hub).

    python3 scripts/gpu/make_models.py --out /tmp/spswap-models --sizes 0.5b 1.5b [3b 7b]
                                       [--seed N] [--check] [--plain]

Each directory gets config.json, generation_config.json and model*.safetensors (sharded
at --shard-gib, with model.safetensors.index.json) in bf16, deterministic from --seed
(one generator per tensor), no tokenizer: load with ``skip_tokenizer_init=True`` and
token-id prompts. The shapes are Qwen2's 0.5B / 1.5B / 3B / 7B; the weights are
"peaked" by default (see PEAK_LOGIT: greedy answers with clear winners, so they repeat
and differ per seed; the LM head is then untied) and ``--plain`` for plain random ones.
A seed other than 0 goes into the directory name (``qwen2-1.5b-s7``). ``--check`` asks
vLLM whether the greedy answers repeat. Runs on a GPU machine (the tensors are drawn
there, fast) or on CPU (slow for 7B). After writing, the files are dropped from the page
cache so a first load reads the disk.
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
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
               tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False),
}  # fmt: skip
INIT_STD = 0.02
# Peaked weights (the default): greedy decoding must have clear winners, or vLLM's own
# batch-shape-dependent kernels make a plain cold repeat differ (measured: random 1.5B
# answers differed at tokens 8, 5, 2 of their prompts), and "identical to cold" proves
# nothing. The residual stream is kept close to the input token's embedding (the
# layers' output projections are small) and an untied LM head maps token t to a
# seed-chosen next token with a logit margin of ~PEAK_LOGIT: answers follow a
# permutation of the vocabulary that differs per seed, so another model's (or corrupted
# embedding or head) weights give other answers. The layers only nudge the logits.
PEAK_LOGIT = 30.0
EMBED_STD = 1.0
RESIDUAL_STD = 0.002  # o_proj and down_proj: what each layer adds to the stream


def qwen2_config(size: str, max_position_embeddings: int = 32768, *,
                 peaked: bool = False) -> dict[str, Any]:  # fmt: skip
    """A Qwen2ForCausalLM config.json for one of :data:`SHAPES` (peaked: the LM head is
    its own tensor)."""
    if size not in SHAPES:
        raise SystemExit(f"unknown size {size!r}; choose from {', '.join(SHAPES)}")
    shape = dict(SHAPES[size], **({"tie_word_embeddings": False} if peaked else {}))
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_dropout": 0.0,
        "initializer_range": INIT_STD, "use_cache": True, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": SHAPES[size]["num_hidden_layers"],
        "max_position_embeddings": max_position_embeddings, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "bfloat16", **shape,
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


def model_dir_name(size: str, seed: int, peaked: bool) -> str:
    """``qwen2-1.5b`` (seed 0, peaked), ``qwen2-1.5b-s7``, ``qwen2-1.5b-plain``."""
    return f"qwen2-{size}" + (f"-s{seed}" if seed else "") + ("" if peaked else "-plain")


def draw(name: str, shape: tuple[int, ...], g: Any, device: str, *, peaked: bool,
         embed: Any = None) -> Any:  # fmt: skip
    """One tensor in bf16: norms 1; the rest normal, peaked as described above."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if peaked and name == "lm_head.weight":
        perm = torch.randperm(shape[0], generator=g, device=device)
        # logit of the chosen token: PEAK_LOGIT (the final norm makes the stream's rms 1)
        return (embed[perm].float() * (PEAK_LOGIT / (EMBED_STD * shape[1]))).to(torch.bfloat16)
    std = INIT_STD
    if peaked and name == "model.embed_tokens.weight":
        std = EMBED_STD
    elif peaked and name.endswith(("o_proj.weight", "down_proj.weight")):
        std = RESIDUAL_STD
    t = torch.empty(shape, dtype=torch.float32, device=device)
    t.normal_(0.0, std, generator=g)
    return t.to(torch.bfloat16)


def write_model(out_dir: Path, size: str, *, seed: int, shard_bytes: int,
                peaked: bool = True) -> dict[str, Any]:  # fmt: skip
    """Write one model directory; returns what was written."""
    import torch
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = qwen2_config(size, peaked=peaked)
    d = out_dir / model_dir_name(size, seed, peaked)
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
    embed = None
    for names, fname in zip(shards, files, strict=True):
        tensors = {}
        for name in names:
            g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
            index += 1
            t = draw(name, shapes[name], g, device, peaked=peaked, embed=embed)
            if name == "model.embed_tokens.weight" and peaked:
                embed = t  # the LM head is a permutation of it
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
    return {"dir": str(d), "size": size, "bytes": total, "files": files, "peaked": peaked,
            "params": total // 2, "seconds": time.perf_counter() - start}  # fmt: skip


CHECK_PROMPTS = ([11, 23, 5, 42, 7, 19, 3, 31], [1, 2, 3, 4, 5], [10, 20, 30], [7] * 16)


def check_repeats(model: Path, max_new_tokens: int = 16) -> dict[str, Any]:
    """Greedy answers of one vLLM engine (eager, small KV cache) asked one prompt at a
    time and all at once, twice: they must be identical, and the smallest margin between
    the first and second choice says how far from a tie decoding ran."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
              kv_cache_memory_bytes=2 << 30, max_model_len=1024, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True,
                            logprobs=2, detokenize=False)  # fmt: skip
    prompts = [{"prompt_token_ids": list(p)} for p in CHECK_PROMPTS]

    def answers(batch: bool) -> tuple[list[list[int]], float]:
        outs = llm.generate(prompts, params, use_tqdm=False) if batch else \
            [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # fmt: skip
        margin = min(sorted((lp.logprob for lp in step.values()), reverse=True)[0] -
                     sorted((lp.logprob for lp in step.values()), reverse=True)[1]
                     for o in outs for step in o.outputs[0].logprobs if len(step) > 1)  # fmt: skip
        return [list(o.outputs[0].token_ids) for o in outs], margin

    runs = [answers(batch) for batch in (False, True, False, True)]
    same = all(r[0] == runs[0][0] for r in runs)
    return {
        "dir": str(model),
        "identical": same,
        "min_margin": min(r[1] for r in runs),
        "answers": runs[0][0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/spswap-models"))
    ap.add_argument("--sizes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gib", type=float, default=4.0)
    ap.add_argument(
        "--plain",
        action="store_true",
        help="plain random weights (greedy answers near ties: not for identity checks)",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="after writing, check with vLLM that greedy answers repeat (one at a "
        "time and batched, twice) and print the smallest top-2 margin",
    )
    args = ap.parse_args(argv)  # fmt: skip
    ok = True
    for size in args.sizes:
        info = write_model(args.out, size, seed=args.seed, peaked=not args.plain,
                           shard_bytes=int(args.shard_gib * (1 << 30)))  # fmt: skip
        print(json.dumps(info), flush=True)
        if args.check:
            check = check_repeats(Path(info["dir"]))
            print(json.dumps({"check": check}), flush=True)
            ok = ok and check["identical"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
