"""Wall time of compress / decompress calls and batches for torch and CuPy callers on a GPU
(development aid; timeit minimum of 5 x 20 calls, GC off as timeit has it, each call synchronised
by its own read-back).  The torch and CuPy rows run the same kernels, so their difference is
what the framework costs on the host: imports, stream handling, building results.

    python benchmarks/framework_calls.py

Figures from it are in benchmarks/NOTES.md (v12, v13).
"""
import timeit, numpy as np, cupy, torch, kvzip
from kvzip.data import load_sample
def t(label, stmt, n=20, **g):
    s = min(timeit.repeat(stmt, globals={**globals(), **g}, number=n, repeat=5)) / n
    print(f"{label:<40}{s*1e6:9.1f} us")
sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
y = cupy.asarray(np.resize(sample, 1 << 28))
parts = [y[i * (1 << 22):(i + 1) * (1 << 22)] for i in range(64)]
tparts = [torch.as_tensor(p, device="cuda").view(torch.bfloat16) for p in parts]
for _ in range(2):
    tb = kvzip.compress_many(tparts); kvzip.decompress_many(tb)
    cb = kvzip.compress_many(parts, dtype="bf16"); kvzip.decompress_many(cb)
t("torch compress_many 64 x 8 MiB", "kvzip.compress_many(tparts)")
t("torch decompress_many 64 x 8 MiB", "kvzip.decompress_many(tb)")
t("cupy compress_many 64 x 8 MiB", "kvzip.compress_many(parts, dtype='bf16')")
t("cupy decompress_many 64 x 8 MiB", "kvzip.decompress_many(cb)")
t2 = tparts[0].reshape(1024, 4096)
b2 = kvzip.compress(t2); kvzip.compress(t2); kvzip.decompress(b2); kvzip.decompress(b2)
assert torch.equal(kvzip.decompress(b2).view(torch.int16), t2.view(torch.int16))
t("torch compress 8 MiB", "kvzip.compress(t2)", n=50)
t("torch decompress 8 MiB", "kvzip.decompress(b2)", n=50)
c2 = parts[0]
cb2 = kvzip.compress(c2, dtype="bf16"); kvzip.decompress(cb2)
t("cupy compress 8 MiB", "kvzip.compress(c2, dtype='bf16')", n=50)
t("cupy decompress 8 MiB", "kvzip.decompress(cb2)", n=50)
