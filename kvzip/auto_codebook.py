"""The automatic per-tensor codebook: a Top-16 chosen from a sample of the tensor's own exponents.

This module is the reference for the rule; a GPU kernel implements the same rule, so everything
below is defined on the tensor's raw bits with integer arithmetic only, and the result is a pure
function of those bits.  A tensor is the flat array of its ``n`` values in memory order
(``bits[0 .. n-1]``, the format's unsigned integer of 8, 16 or 32 bits).

**1. Which values are read (the sample).**  With ``L = RUN_LENGTH = 256`` and ``A = ALIGN = 16``::

    k      = min(MAX_SHIFT, max(0, bit_length(n) - 20))   # bit_length(n) = floor(log2 n) + 1, 0 for n = 0
    S      = L << k                                       # block size: 256, 512, ..., 8192 values
    blocks = ceil(n / S)                                  # block i holds values [i*S, (i+1)*S)
    M      = (S - L) / A + 1                              # offsets a run can take in its block
    J(i)   = (((i * WEYL) mod 2^32) * M) >> 32            # WEYL = 0x9E3779B9; the product fits 64 bits
    start(i) = i*S + A*J(i)
    run(i) = [start(i), start(i) + L)  intersected with [0, n)

The sample is the union of ``run(i)`` for ``0 <= i < blocks``: one run of 256 consecutive values
from every block of ``S``, at an offset that is a multiple of 16 values and never runs past its
block.  On a GPU: ``J = __umulhi(i * 0x9E3779B9u, M)`` in uint32 (``i`` taken mod 2^32).

* ``n < 2^20`` (``FULL_READ_BELOW``): ``k = 0``, ``S = L``, ``M = 1``, ``J = 0``: every value is read.
* ``2^(19+k) <= n < 2^(20+k)`` for ``k = 1..4``: one value in ``2^k`` is read.
* ``2^(19+k) <= n < 2^(20+k)`` for ``k = 5..7``: likewise, 1/32 to 1/128.
* ``n >= 2^27``: ``k = 8``, ``S = 65536``: one value in 256 (plus at most one partial run at
  the end).
* So at most 2^20 values are read for any ``n < 2^28`` (``blocks <= 2^12`` there), and at most
  ``256 * ceil(n / 65536)`` (``n/256`` rounded up to a run) beyond; a sampled tensor (``n >= 2^20``)
  always gives at least 2048 runs and 2^19 values.
* The last block may be partial (``n`` need not be a multiple of ``S``): its run is cut at ``n``,
  and is empty when ``start(i) >= n``.  ``n = 0``: no blocks, nothing read.

``sample_plan(n)`` returns ``(run_length, block, blocks, offsets)`` = ``(L, S, blocks, M)`` and
``run_starts(n)`` every ``start(i)``; ``sample_indices(n)`` lists the sampled value indices.

**2. The histogram.**  ``count[e]`` = number of sampled values whose exponent field
``(bits >> M_bits) & (2^E - 1)`` is ``e`` (sign ignored; zeros, subnormals, Inf and NaN count
under their exponent like any value).  2^E bins: 256 for bf16 and fp32, 32 for fp16 and e5m2,
16 for e4m3.  Counts need 32 bits for any sample under 2^32 values (``n < 2^37``).

**3. The choice** (kvzip.calibrate.choose_exponents with ``always_include=(0,)``, restated):

* ``mode`` = the lowest exponent among those of the largest count (0 when nothing was read);
* rank every exponent ``e`` by the key, ascending:
  ``(count[e] == 0, -count[e] if count[e] > 0 else |e - mode|, e)``: seen exponents first, by
  count descending, ties to the lower exponent; then unseen ones nearest the mode first, ties
  to the lower exponent;
* take the first 16 by rank; if exponent 0 is not among them, it replaces the 16th (the lowest
  ranked of the 16), which puts 0 last;
* code ``c`` (0..15) is the ``c``-th of the 16 in rank order: code 0 is the most frequent
  exponent.  E4M3 has exactly 16 exponents: the codebook is all of them, in rank order.

Why these constants:

* ``RUN_LENGTH = 256`` values: a whole number of head vectors for head dimensions 32, 64, 128 and
  256, so every channel of a head is read equally often whatever the run's start (a stride of 64
  single values once read one channel per head and chose codebooks 8 % worse, NOTES a1); and
  one warp-wide load (32 lanes x 16 bytes for bf16).  256 is the shortest run allowed, and for a
  fixed number of bytes short runs give the most runs, i.e. the most places visited.
* ``ALIGN = 16`` values: run starts stay 16-byte aligned (with an aligned base) in every format,
  so a GPU can read a run with vector loads.
* The offset ``J(i)`` (a Weyl sequence on the golden ratio: deterministic, not random) varies the
  run's place inside its block.  With a fixed offset every run starts at a multiple of ``S``, and
  any structure whose period divides ``S`` or is a multiple of it is read at the same few phases:
  a layer of SmolLM2 at 512 tokens is ``[3, 512, 64]``, so runs 8192 values apart read tokens
  0-3, 128-131, 256-259 and 384-387 of every head and no others; on KV whose token t is scaled by
  2^(t % 8 - 4) (a period of 512 values) fixed offsets chose codebooks up to 19 % worse than the
  tensor's own (NOTES a2).  The varying offset reads every phase and lost nothing there.
* ``FULL_READ_BELOW = 2^20`` and the halving ladder: below 2^20 values (2 MiB of bf16) a read of
  everything costs a GPU well under a microsecond, less than the launch it rides on, and gives
  the tensor's own Top-16 exactly; above, the sample never drops under 2^19 values in 2048 runs,
  so a tensor of 2^20 values is not chosen from 2^15 of them.
* ``MAX_SHIFT = 8``: at most 2^20 values read below 2^28, 1/256 of a tensor beyond; the GPU
  reads the sample in latency-bound steps, so every halving of it comes off each encode
  (benchmarks/NOTES.md a3 has the figures).  The survey found 1/256 blocks as good as the full
  histogram on every tensor it has (a2).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .calibrate import choose_exponents, exponent_histogram
from .codebook import Codebook, _as_format

RUN_LENGTH = 256           # values per run: whole head vectors for head_dim 32..256; one warp load
ALIGN = 16                 # run starts are multiples of 16 values: 16-byte aligned in every format
FULL_READ_BELOW = 1 << 20  # tensors of fewer values are read whole (k = 0)
MAX_SHIFT = 8              # block = RUN_LENGTH << k with k <= 8: at most 1/256 of a large tensor
WEYL = 0x9E3779B9          # round(2^32 / golden ratio): the run offsets' low-discrepancy step

_GATHER_BLOCKS = 4096      # runs gathered per NumPy fancy-index call on the CPU (an 8 MiB index)


class SamplePlan(NamedTuple):
    """How a tensor of ``n`` values is sampled (see the module docstring)."""

    run_length: int  # L: values per run
    block: int       # S: one run per block of S values; the fraction read is L / S
    blocks: int      # ceil(n / S): the number of runs, the last one possibly cut short or empty
    offsets: int     # M: a run starts at one of M multiples of ALIGN in its block (J(i) < M)


def sample_plan(n: int) -> SamplePlan:
    """The sample's shape for a tensor of ``n`` values."""
    n = _check_n(n)
    k = min(MAX_SHIFT, max(0, n.bit_length() - FULL_READ_BELOW.bit_length() + 1))
    block = RUN_LENGTH << k
    return SamplePlan(RUN_LENGTH, block, -(-n // block), (block - RUN_LENGTH) // ALIGN + 1)


def run_starts(n: int) -> np.ndarray:
    """int64[blocks]: where each run starts, ``i*S + ALIGN*J(i)``; run ``i`` covers
    ``[start, min(start + L, n))`` (empty when ``start >= n``)."""
    plan = sample_plan(n)
    i = np.arange(plan.blocks, dtype=np.uint64)
    h = (i * np.uint64(WEYL)) & np.uint64(0xFFFFFFFF)       # i * WEYL mod 2^32
    j = (h * np.uint64(plan.offsets)) >> np.uint64(32)       # < 2^32 * 497: fits 64 bits
    return (i * np.uint64(plan.block) + j * np.uint64(ALIGN)).astype(np.int64)


def sample_indices(n: int) -> np.ndarray:
    """int64: every value index the sample reads, ascending (for tests and for checking a GPU
    implementation; the sampler itself never materialises it)."""
    n = _check_n(n)
    starts = run_starts(n)
    idx = (starts[:, None] + np.arange(RUN_LENGTH, dtype=np.int64)).reshape(-1)
    return idx[idx < n]


def sample_histogram(bits: np.ndarray, fmt) -> np.ndarray:
    """int64[2**E]: exponent counts of the sampled values of ``bits`` (flat raw bits)."""
    fmt = _as_format(fmt)
    flat = _flat_bits(bits, fmt)
    n = flat.size
    plan = sample_plan(n)
    if plan.block == plan.run_length:  # the whole tensor
        return exponent_histogram(flat, fmt)
    hist = np.zeros(1 << fmt.exp_bits, dtype=np.int64)
    starts = run_starts(n)
    whole = int(np.searchsorted(starts, n - RUN_LENGTH, side="right"))  # runs entirely inside
    lanes = np.arange(RUN_LENGTH, dtype=np.int64)
    for first in range(0, whole, _GATHER_BLOCKS):
        part = starts[first:min(whole, first + _GATHER_BLOCKS)]
        hist += exponent_histogram(flat[part[:, None] + lanes], fmt)
    for s in starts[whole:]:  # at most one run reaches past the end; it is cut there
        if s < n:
            hist += exponent_histogram(flat[s:n], fmt)
    return hist


def auto_codebook(bits: np.ndarray, fmt) -> Codebook:
    """The automatic Top-16 codebook of one tensor (the rule in the module docstring).

    ``bits``: the tensor's raw bits as a NumPy array of the format's unsigned (or signed)
    integer type, flattened in memory order (any shape is flattened C-order).  The codebook has
    no name; its ``coverage`` is the sample's (the fraction of sampled values given a code).
    """
    fmt = _as_format(fmt)
    return _chosen(sample_histogram(bits, fmt), fmt)


def _chosen(hist: np.ndarray, fmt) -> Codebook:
    """The codebook of a sample's exponent histogram (rule 3); its coverage is the sample's."""
    exps = choose_exponents(hist, (0,))
    total = int(hist.sum())
    coverage = int(hist[list(exps)].sum()) / total if total else 1.0
    return Codebook(exps, fmt, name=None, coverage=coverage)


AUTO = "auto"  # what codebook= says for this rule (Top16Pack records it in the pipeline config)


def auto_codebook_on(backend, flat, fmt, exponents: bool = False) -> Codebook:
    """auto_codebook of a flat array on any backend (the staged executor's; the GPU executor has a
    kernel of its own): the sample is gathered where the array lives and counted on the host.
    exponents: flat holds the exponent fields already (ExponentSplit's stream), not the values."""
    fmt = _as_format(fmt)
    n = int(flat.shape[0])
    if backend.name == "cpu" and not exponents:
        return auto_codebook(flat, fmt)
    whole = sample_plan(n).block == RUN_LENGTH
    sample = backend.to_numpy(flat if whole else flat[backend.from_numpy(sample_indices(n))])
    if exponents:
        return _chosen(np.bincount(sample, minlength=1 << fmt.exp_bits)[:1 << fmt.exp_bits], fmt)
    return _chosen(exponent_histogram(sample, fmt), fmt)


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"a tensor size must be a non-negative int, got {n!r}")
    return int(n)


def _flat_bits(bits, fmt) -> np.ndarray:
    a = np.asarray(bits)
    if a.dtype.kind not in "ui" or a.dtype.itemsize != fmt.itemsize:
        raise ValueError(f"expected {fmt.width}-bit integer bits of {fmt.name} values, got dtype {a.dtype}")
    return a.view(fmt.uint_dtype).reshape(-1)
