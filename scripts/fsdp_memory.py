"""Expected memory per GPU of a bk step under FSDP2, computed from the model's shape (an estimate, not a measurement).

    python scripts/fsdp_memory.py --shape llama3-8b --gpus 8 --batch 8 --seq 512
    python scripts/fsdp_memory.py --shape llama3-8b --gpus 8 --batch 8 --seq 512 --gradient-checkpointing

Full fine-tuning, fp32 shards (parameters, gradients, AdamW's two moments: 16 bytes per parameter, divided over
the GPUs), bf16 compute (FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, dpllm's
``train.mixed_precision: bf16``). What each term counts, per GPU (B records of T tokens on each):

- ``sharded state``: 16 B × parameters / GPUs. bk adds no gradient copy: the accumulated clipped sum *is* the
  sharded gradient (:mod:`dpllm.privacy.bk.optimizer`), and the noise is drawn one shard-tensor at a time.
- ``gathered parameters``: the root group (embeddings, final norm, untied head), gathered for the whole step, and
  two transformer blocks (the one running and the one prefetched), bf16.
- ``activations``: what autograd keeps per token and block for a Llama block with SDPA attention
  (7h + 2·kv + 4i values, bf16: the inputs of the norms and projections, q/k/v/out of attention, the MLP's
  gate, up and product), or only each block's input under gradient checkpointing (plus one block recomputed).
- ``bk records``: what bk holds from a layer's backward until the end of the backward pass, for every layer of
  every block: the inputs a (shared by q/k/v and by gate/up: 3h + i per token) and output gradients g
  (3h + 2·kv + 2i) of the projections under the ghost norm (chosen when T·(d_in + d_out) < d_in·d_out, true
  for every projection of these shapes at T ≥ 128), in bf16; and the head's g (T·V per record, bf16).
- ``loss``: the float32 logits, their log-softmax and their gradient (3 × 4 B × B·T·V).
- ``clipped-sum transient``: the largest parameter's full-shape fp32 clipped sum and its reduce-scatter input
  (2 × 4 B × its size): bk forms one parameter's sum at a time.

The peak is the larger of the end of the forward pass (activations + loss) and the end of the backward pass (bk
records + transient), on top of the sharded state and the gathered parameters. Allocator fragmentation,
CUDA/NCCL workspaces (~1-3 GB) and the optimizer step's temporaries are not counted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 2**30


def estimate(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
             gpus: int, batch: int, seq: int, gradient_checkpointing: bool = False) -> dict:
    """Bytes per GPU, by term (see the module docstring)."""
    h, i, kv = hidden, intermediate, hidden * kv_heads // heads
    block = h * (h + 2 * kv + h) + 3 * h * i + 2 * h  # q k v o, gate up down, two norms
    embed = vocab * h
    root = embed * (1 if tied else 2) + h
    params = layers * block + root
    tokens = batch * seq
    per_block = (h if gradient_checkpointing else 7 * h + 2 * kv + 4 * i) * 2
    recompute = (7 * h + 2 * kv + 4 * i) * 2 * tokens if gradient_checkpointing else 0
    terms = {
        "sharded state": 16 * params / gpus,
        "gathered parameters": 2 * (root + 2 * block),
        "activations": per_block * tokens * layers + recompute,
        "loss": 3 * 4 * tokens * vocab,
        "bk records": ((6 * h + 2 * kv + 3 * i) * layers + vocab) * 2 * tokens,
        "clipped-sum transient": 2 * 4 * embed,
    }
    forward = terms["activations"] + terms["loss"]
    backward = terms["bk records"] + terms["clipped-sum transient"]
    terms["peak"] = terms["sharded state"] + terms["gathered parameters"] + max(forward, backward)
    terms["parameters"] = params
    return terms


def llama_shapes() -> dict:
    """The Llama-style shapes of ``scripts/bench_overhead.py`` (name → config), as the estimators read them."""
    from bench_overhead import SHAPES

    return {k: v for k, v in SHAPES.items() if v["arch"] != "gpt2"}


def shape_args(config: dict) -> dict:
    """The keyword arguments of the estimators (:func:`estimate`, ``qlora_memory.estimate``) from a model config."""
    return dict(hidden=config["hidden_size"], intermediate=config["intermediate_size"],
                layers=config["num_hidden_layers"], heads=config["num_attention_heads"],
                kv_heads=config["num_key_value_heads"], vocab=config["vocab_size"],
                tied=config.get("tie_word_embeddings", False))


def main(argv=None) -> dict:
    shapes = llama_shapes()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(shapes))
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="records per GPU per physical batch")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args(argv)
    est = estimate(**shape_args(shapes[args.shape]), gpus=args.gpus, batch=args.batch, seq=args.seq,
                   gradient_checkpointing=args.gradient_checkpointing)
    print(f"{args.shape}: {est['parameters'] / 1e9:.2f}B parameters, {args.gpus} GPUs, {args.batch} × {args.seq} "
          f"tokens per GPU{', gradient checkpointing' if args.gradient_checkpointing else ''} (estimate, not measured)")
    for k, v in est.items():
        if k != "parameters":
            print(f"  {k:24s} {v / GiB:7.1f} GiB")
    return est


if __name__ == "__main__":
    main()
