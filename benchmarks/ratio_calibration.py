"""What calibrated channel tables cost or buy the ratio mode against each tensor's own, measured
on the CPU (ratios only: the GPU writes the same bytes).

    python benchmarks/ratio_calibration.py [--data ../shared/data/kv] [--out DIR]

For each model family in DATA (SmolLM2-135M: prose, code, HTML; MiniLM-L6: prose, code), the
tables are calibrated on the family's prose file (kvzip.calibrate_channels, every value of every
layer tensor) and every layer tensor of every file of the family is compressed with
mode="ratio" twice: with its own tables (the default, chosen from the tensor) and with the
calibrated ones.  The prose rows are in-sample, the others held out.  The same for pages: the
first 16 tokens of each layer tensor ([heads, 16, head_dim], a paged cache's block), where a
tensor's own tables come from a few dozen values a channel; and for variants of the held-out
tensors that the calibration never saw (kvzip.testing.kv_variant: per-layer and per-channel
power-of-two scales, exact zeros, a wide exponent range).  Every blob is decoded and checked.

The storage mode is asked the same question, although it takes no calibrated tables: its
tables are made from the prose file's counts by its own writer's rule (stages/channel_rans.py:
choose_shift, group_tables, every escape given a count of 1 so that unseen exponents stay
codable), each held-out layer tensor is coded with them by its CPU kernels
(channel_rans_cpu.encode), and the blob's size is what its compact header and layout give
(the kernels' streams placed by kvzip/layout.py, as Serialize places them).  "storage_layers":
own tables (kvzip.compress(mode="storage")) against those.
Writes DIR/ratio-calibration-cpu.json (machine, versions, commit and date inside).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import kvzip
from kvzip.bench_cpu import code_commit
from kvzip.testing import KV_VARIANTS, kv_variant

PAGE_TOKENS = 16
FAMILIES = {"smollm2-135m": ("prose_2048", "code_512", "html_512"), "minilm-l6": ("prose_2048", "code_1024")}


def load(path: Path) -> dict:
    """{name: uint16 bits [heads, tokens, head_dim]} of a BF16 .safetensors file."""
    import torch
    from safetensors.torch import load_file

    return {k: v.view(torch.int16).numpy().view(np.uint16) for k, v in sorted(load_file(path).items())}


def ratio(tensors: list, codebook) -> float:
    """Raw bytes over blob bytes of the tensors compressed one by one, each checked lossless."""
    raw = stored = 0
    for x in tensors:
        blob = kvzip.compress(x, codebook=codebook, dtype="bf16", mode="ratio")
        back = np.asarray(kvzip.decompress(blob)).view(np.uint16)
        if not np.array_equal(back, x):
            raise AssertionError("ratio mode round trip differs")
        raw, stored = raw + x.nbytes, stored + len(blob)
    return raw / stored


def row(tensors: list, codebook) -> dict:
    own, cal = ratio(tensors, None), ratio(tensors, codebook)
    return {"tensors": len(tensors), "own": round(own, 5), "calibrated": round(cal, 5),
            "calibrated_vs_own": round(cal / own, 5)}


def storage_calibrated_size(x: np.ndarray, tables: np.ndarray) -> int:
    """Bytes of x's storage-mode blob had it been coded with the tables stream ``tables``."""
    from kvzip import layout
    from kvzip.bitpack import groups
    from kvzip.formats import FORMATS
    from kvzip.stages import ChannelRans, channel_rans as cr, channel_rans_cpu

    fmt, n, C = FORMATS["bf16"], x.size, ChannelRans.DEFAULT_CHUNK
    channels = x.shape[-1]
    shift, freq, cum, _ = cr.parse_tables(tables, channels, fmt.exp_bits)
    nchunks = -(-n // C)
    rest = np.empty(fmt.rest_bits * groups(n), np.uint8)
    states = np.empty(cr.LANES * nchunks, np.uint32)
    counts = np.empty(nchunks, np.uint32), np.empty(nchunks, np.uint32)
    words, esc_exp = channel_rans_cpu.encode(x.reshape(-1), n, fmt, channels, shift, freq, cum, C, rest, states, *counts)
    streams = [rest.nbytes, states.nbytes, words.nbytes, counts[0].nbytes, counts[1].nbytes, esc_exp.nbytes, tables.nbytes]
    return layout.COMPACT_SIZE + layout.place(streams)[1]


def storage_tables(tensors: list) -> np.ndarray:
    """The storage mode's tables stream from the counts of every value of the tensors (the
    writer's rule; every group's escape count at least 1)."""
    from kvzip.channel_codebook import channel_counts
    from kvzip.formats import FORMATS
    from kvzip.stages import channel_rans as cr

    fmt = FORMATS["bf16"]
    hist = sum(channel_counts(x.reshape(-1), fmt, x.shape[-1]) for x in tensors)
    shift = cr.choose_shift(hist, fmt.exp_bits)
    merged = cr._merged(hist, shift)
    groups = []
    for row, (lo, hi, _) in zip(merged, cr.group_tables(hist, shift)):
        inside = row[lo:hi + 1]
        groups.append((lo, hi, cr._freqs(np.concatenate(([max(1, int(row.sum() - inside.sum()))], inside)))))
    return cr.tables_bytes(shift, groups)


def storage_row(calibration: list, tensors: list) -> dict:
    tables = storage_tables(calibration)
    raw = sum(x.nbytes for x in tensors)
    own = raw / sum(len(kvzip.compress(x, dtype="bf16", mode="storage")) for x in tensors)
    cal = raw / sum(storage_calibrated_size(x, tables) for x in tensors)
    return {"tensors": len(tensors), "own": round(own, 5), "calibrated": round(cal, 5),
            "calibrated_vs_own": round(cal / own, 5)}


def run(data: Path) -> dict:
    out = {}
    for family, files in FAMILIES.items():
        layers = {f: load(data / f"{family}_{f}.safetensors") for f in files}
        cb = kvzip.calibrate_channels(list(layers[files[0]].values()), format="bf16", name=f"{family}-prose")
        res = {"calibrated_on": f"{family}_{files[0]}", "channels": cb.channels}
        for f, tensors in layers.items():
            xs = list(tensors.values())
            res[f] = {"layers": row(xs, cb), "pages": row([np.ascontiguousarray(x[:, :PAGE_TOKENS]) for x in xs], cb)}
            print(family, f, res[f], flush=True)
        held_out = [x for f in files[1:] for x in layers[f].values()]
        res["storage_layers"] = storage_row(list(layers[files[0]].values()), held_out)
        print(family, "storage", res["storage_layers"], flush=True)
        res["variants"] = {}
        for variant in KV_VARIANTS:
            xs = [kv_variant(x, variant, layer=i) for i, x in enumerate(held_out)]
            res["variants"][variant] = row(xs, cb)
            print(family, variant, res["variants"][variant], flush=True)
        out[family] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "kv"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": code_commit(),
           "machine": platform.machine(), "python": sys.version.split()[0], "numpy": np.__version__,
           "kvzip": kvzip.__version__, "page_tokens": PAGE_TOKENS, "families": run(Path(a.data))}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    path = Path(a.out) / "ratio-calibration-cpu.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
