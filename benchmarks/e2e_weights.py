"""End to end: a Llama-architecture model with ZipLinear against the same model with nn.Linear,
greedy decoding, tokens/s with CUDA graphs, at batch 1 and 16; plus the linear weights' bytes in
GPU memory and the agreement of the greedy tokens.

    python benchmarks/e2e_weights.py --out benchmarks/results              # Llama-3-8B dimensions
    python benchmarks/e2e_weights.py --layers 2 --hidden 256 ...           # a small smoke run

The model is built from a transformers LlamaConfig with Llama-3-8B's dimensions (hidden 4096,
MLP 14336, 32 layers, 32 heads, 8 KV heads, vocabulary 128256) and transformers' own random
initialisation (normal, std 0.02), in BF16: no download.  One decode step (batch B, one token,
a static KV cache) is captured in a CUDA graph and replayed; tokens/s = B x steps / time.  The
greedy tokens of both models are compared over the same steps from the same prompt.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_weights import environment  # noqa: E402

import kvzip.weights as kw  # noqa: E402
from kvzip.bench import torch_gpu_tag  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.mlp, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         max_position_embeddings=args.prompt + args.steps + 8, rope_theta=500000.0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval(), config


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def linear_bytes(model) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, kw.ZipLinear):
            total += m.tiled.nbytes
    return total


@torch.no_grad()
def decode_rate(model, config, batch, prompt_len, steps, graphs=True):
    """(tokens/s, greedy tokens (batch x steps), how it was timed)."""
    from transformers import StaticCache

    g = torch.Generator(device=DEVICE).manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), device=DEVICE, generator=g)
    cache = StaticCache(config=config, max_cache_len=prompt_len + steps + 1)
    out = model(input_ids=prompt, past_key_values=cache, use_cache=True,
                cache_position=torch.arange(prompt_len, device=DEVICE))
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    ids = torch.empty(batch, 1, dtype=torch.long, device=DEVICE)
    pos = torch.empty(1, dtype=torch.long, device=DEVICE)

    def step():
        return model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos).logits[:, -1]

    how = "cuda graph of one decode step, replayed"
    graph = None
    if DEVICE == "cpu":
        how = "eager, on the CPU (a smoke run)"
    elif graphs:
        try:
            ids.copy_(token)
            pos.fill_(prompt_len)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = step()
            for layer in cache.layers:  # the warm-up steps advanced the cache's own write position
                layer.cumulative_length.fill_(prompt_len)
        except Exception as e:  # noqa: BLE001 (reported, then timed eagerly)
            graph, how = None, f"eager (graph capture failed: {type(e).__name__}: {e})"[:300]
    tokens = []
    _sync()
    t0 = time.perf_counter()
    for i in range(steps):
        ids.copy_(token)
        pos.fill_(prompt_len + i)
        if graph is not None:
            graph.replay()
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = step().argmax(-1, keepdim=True)
        tokens.append(nxt)
        token = nxt
    _sync()
    elapsed = time.perf_counter() - t0
    return batch * steps / elapsed, torch.cat(tokens, 1).cpu(), how


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tag", default=None,
                    help="the result files' suffix (default: the GPU's short name, kvzip.bench.gpu_tag)")
    args = ap.parse_args(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    model, config = build(args)
    result = {"environment": environment(), "model": {k: getattr(args, k) for k in
                                                      ("hidden", "mlp", "layers", "heads", "kv_heads", "vocab")},
              "prompt": args.prompt, "steps": args.steps, "runs": {}}
    dense_bytes = linear_bytes(model)
    base = {}
    for b in (int(v) for v in args.batches.split(",")):
        rate, tokens, how = decode_rate(model, config, b, args.prompt, args.steps)
        base[b] = (rate, tokens)
        log(f"nn.Linear batch {b}: {rate:.1f} tokens/s ({how})")
        result["runs"][f"linear_b{b}"] = {"tokens_per_s": rate, "timing": how}
    t0 = time.perf_counter()
    kw.compress_model(model)
    _sync()
    result["compress_s"] = time.perf_counter() - t0
    zip_bytes = linear_bytes(model)
    result["linear_bytes"] = {"nn.Linear": dense_bytes, "ZipLinear": zip_bytes, "ratio": dense_bytes / zip_bytes}
    log(f"linear weights {dense_bytes / 1e9:.3f} GB -> {zip_bytes / 1e9:.3f} GB ({dense_bytes / zip_bytes:.4f}x), "
        f"compressed in {result['compress_s']:.1f} s")
    for b, (rate0, tokens0) in base.items():
        rate, tokens, how = decode_rate(model, config, b, args.prompt, args.steps)
        same = (tokens == tokens0).all(dim=1)
        first_diff = [int((row != row0).nonzero()[0]) if not bool(s) else None
                      for row, row0, s in zip(tokens, tokens0, same)]
        result["runs"][f"ziplinear_b{b}"] = {"tokens_per_s": rate, "timing": how, "speedup": rate / rate0,
                                             "sequences_identical": int(same.sum()), "sequences": b,
                                             "first_difference": first_diff}
        log(f"ZipLinear batch {b}: {rate:.1f} tokens/s, {rate / rate0:.3f}x; greedy tokens identical in "
            f"{int(same.sum())}/{b} sequences of {args.steps} steps")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"e2e-weights-{args.tag or torch_gpu_tag()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
