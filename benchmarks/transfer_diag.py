"""What a transfer group costs on one GPU: kvzip's calls alone, and beside a second process.

1. One process, one side stream: compress_many / decompress_many of one group (K and V of one
   Llama-3-8B layer at 32K tokens, 2 x 64 MiB, real KV tiled), checksum off and on, and sum64
   of a 64 MiB payload (the fused kernel against the array-at-a-time form it replaced).
2. The same calls while another process keeps the GPU busy with kvzip decodes (what the
   two-process transfer benchmark does on one GPU): without MPS the GPU time-slices between the
   two processes' contexts.
Median of 10 after warm-up, wall time per call (the call's own synchronisation included).
"""
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import kvzip
from kvzip import checksum

from kvzip.testing import real_kv_layers


def timed(f, n=10):
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def old_sum64(xp, payload):
    words = payload.view(xp.uint64)
    terms = checksum.mix(xp, words + xp.arange(words.shape[0], dtype=xp.uint64) * checksum.GOLDEN)
    total = terms.sum(dtype=xp.uint64)
    return int(checksum.mix(np, np.asarray([int(total) ^ payload.shape[0]], dtype=np.uint64))[0])


def calls(tag, out):
    import cupy

    (k, v), = real_kv_layers(1, 32768, "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for cs in (False, True):
            blobs = kvzip.compress_many([k, v], checksum=cs)
            out[f"{tag} compress_many 2x64MiB checksum={cs} ms"] = timed(lambda: kvzip.compress_many([k, v], checksum=cs))
            out[f"{tag} decompress_many checksum={cs} ms"] = timed(lambda: kvzip.decompress_many(blobs))
        u8 = cupy.asarray(k.reshape(-1).view(torch.uint8))
        assert checksum.sum64(cupy, u8) == old_sum64(cupy, u8) == checksum.sum64(np, u8.get())
        out[f"{tag} sum64 fused 64MiB ms"] = timed(lambda: checksum.sum64(cupy, u8))
        out[f"{tag} sum64 array-at-a-time 64MiB ms"] = timed(lambda: old_sum64(cupy, u8))
        out[f"{tag} copy 128MiB ms"] = timed(lambda: torch.cat([k.reshape(-1), v.reshape(-1)]))


BUSY = """
import torch, kvzip, sys, time
from kvzip.testing import real_kv_layers
(k, v), = real_kv_layers(1, 32768, "cuda")
blobs = kvzip.compress_many([k, v], checksum=True)
print("busy", flush=True)
t_end = time.time() + float(sys.argv[1])
while time.time() < t_end:
    kvzip.decompress_many(blobs)
"""


def main():
    out = {"gpu": torch.cuda.get_device_name()}
    calls("alone", out)
    p = subprocess.Popen([sys.executable, "-c", BUSY, "25"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "busy"
    calls("beside a busy process", out)
    p.kill()
    for k, v in out.items():
        print(f"{k:55s} {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    path = sys.argv[1] if len(sys.argv) > 1 else "transfer_diag.json"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
