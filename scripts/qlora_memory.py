"""Expected GPU memory of a QLoRA DP step (bk) on one GPU, computed from the model's shape (an estimate, not a
measurement).

    python scripts/qlora_memory.py --shape llama3-8b --batch 8 --seq 512
    python scripts/qlora_memory.py --shape llama3-8b --batch 8 --seq 512 --gradient-checkpointing

The base's linear layers in NF4 with double quantization (0.5 B per weight + 0.127 bits of constants: a float8
absmax per 64 weights and a float32 one per 256 of those), everything else as peft's
``prepare_model_for_kbit_training`` leaves it (embeddings, norms, untied head cast to float32), LoRA r on the seven
projections in float32 with AdamW, bf16 autocast. What each term counts (B records of T tokens):

- ``base (4-bit)``: the quantized projections.
- ``base (float32)``: embeddings, head and norms, cast to float32 by peft (an 8B Llama's 128k × 4096 embedding
  and head: 4.2 GB, more than the 4-bit projections weigh).
- ``adapters + AdamW``: LoRA parameters, their gradient (bk's clipped sum, noised in place) and AdamW's two
  moments: 16 B per adapter parameter.
- ``activations``: per token and block, what autograd keeps for a Llama block under LoRA (as
  ``scripts/fsdp_memory.py``: 7h + 2·kv + 4i values in bf16), plus each adapter's rank-r intermediate; under
  gradient checkpointing only each block's input, plus one block recomputed.
- ``dequantized transient``: the largest projection dequantized to bf16 for its matmul (forward and backward).
- ``bk records``: bk's stored tensors until the end of the backward pass. Under LoRA the explicit per-record
  gradient is the cheaper rule for the rank-r factors (T·(d_in + d_out) > d_in·d_out for A: d_in·r and B: r·d_out
  at T = 512), so each adapter keeps B × (its parameters) in float32 (:mod:`dpllm.privacy.bk.layers`).
- ``loss``: the float32 logits, their log-softmax and their gradient (3 × 4 B × B·T·V).

The peak is the weights and optimizer state plus the larger of the end of the forward pass (activations + loss)
and the end of the backward pass (bk records + what activations remain), plus the dequantized transient (live in
either); CUDA workspaces and allocator
fragmentation (~1-2 GB) are not counted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 2**30
NF4_BYTES = 0.5 + (8 / 64 + 32 / (64 * 256)) / 8  # 4 bits + double-quantized constants, per weight


def estimate(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
             batch: int, seq: int, lora_r: int = 16, gradient_checkpointing: bool = False) -> dict:
    """Bytes, by term (see the module docstring)."""
    h, i, kv = hidden, intermediate, hidden * kv_heads // heads
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down: (d_in, d_out)
    projections = layers * sum(a * b for a, b in shapes)
    lora = layers * sum(lora_r * (a + b) for a, b in shapes)
    other = vocab * h * (1 if tied else 2) + (2 * layers + 1) * h  # embeddings, head, norms
    tokens = batch * seq
    per_block = (h if gradient_checkpointing else 7 * h + 2 * kv + 4 * i + 7 * lora_r) * 2
    recompute = (7 * h + 2 * kv + 4 * i + 7 * lora_r) * 2 * tokens if gradient_checkpointing else 0
    terms = {
        "base (4-bit)": NF4_BYTES * projections,
        "base (float32)": 4 * other,
        "adapters + AdamW": 16 * lora,
        "activations": per_block * tokens * layers + recompute,
        "dequantized transient": 2 * 2 * max(a * b for a, b in shapes),
        "bk records": 4 * batch * lora,
        "loss": 3 * 4 * tokens * vocab,
    }
    weights = terms["base (4-bit)"] + terms["base (float32)"] + terms["adapters + AdamW"]
    forward = terms["activations"] + terms["loss"]
    backward = terms["bk records"] + terms["activations"] / 2
    terms["peak"] = weights + max(forward, backward) + terms["dequantized transient"]  # the transient: in both
    terms["parameters"] = projections + other
    terms["lora parameters"] = lora
    return terms


def main(argv=None) -> dict:
    from fsdp_memory import llama_shapes, shape_args

    shapes = llama_shapes()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(shapes))
    ap.add_argument("--batch", type=int, default=8, help="records per physical batch")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args(argv)
    est = estimate(**shape_args(shapes[args.shape]), batch=args.batch, seq=args.seq, lora_r=args.lora_r,
                   gradient_checkpointing=args.gradient_checkpointing)
    print(f"{args.shape} QLoRA (NF4, r {args.lora_r}), DP with bk: {est['parameters'] / 1e9:.2f}B parameters, "
          f"{est['lora parameters'] / 1e6:.1f}M adapter parameters, {args.batch} × {args.seq} tokens"
          f"{', gradient checkpointing' if args.gradient_checkpointing else ''} (estimate, not measured)")
    for k, v in est.items():
        if k not in ("parameters", "lora parameters"):
            print(f"  {k:24s} {v / GiB:7.2f} GiB")
    return est


if __name__ == "__main__":
    main()
