"""DFloat11 (Zhang et al., "70% Size, 100% Accuracy", arXiv 2504.11651; PyPI `dfloat11` 0.5.0) as a
baseline for bench_weights.py: its Huffman-coded BF16 format, produced here by a vectorised encoder,
and decoded by the package's own CUDA kernel (its decode.ptx, through CuPy), so that the decoder
measured is DFloat11's.

Why an encoder here: the package's encoder (dfloat11_utils.encode) walks the weights one at a time
in Python, minutes for one 4096 x 14336 matrix; the benchmark's nine shapes would take hours.
`encode` below writes the same bytes from whole-tensor torch operations (on the weight's device);
tests/weights/test_dfloat11_baseline.py checks it against the package's encoder, byte for byte.  The code
table itself comes from the package (dfloat11_utils.get_32bit_codec and get_luts, on a 256-bin
histogram counted on the weight's device).

The format, as the package writes it (threads_per_block T = 512, bytes_per_thread B = 8):
- each weight's 8 exponent bits are Huffman-coded (codes of at most 32 bits, most significant bit
  first, concatenated); when the total is not a whole number of bytes, the end-of-file symbol's
  code follows and only the byte it starts in is kept;
- sign_mantissa: one byte a weight, sign << 7 | mantissa;
- gaps: for each thread's 8 B bytes of the stream, the offset (0..31) of the first code that starts
  in them, 5 bits each, most significant first, zero for threads past the last code's start and up
  to a whole grid of T threads a block;
- output_positions: for each block of T threads, the index of the first weight whose code starts
  in it (the end-of-file code counts as weight n), then n;
- luts: the package's lookup tables for the decoder, then each exponent's code length.

The package is imported from its files, not as a package: its __init__ loads the kernel at import
(and needs pkg_resources), which a CPU machine without CUDA cannot do.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

THREADS = 512           # the package's threads_per_block
BYTES_PER_THREAD = 8    # the package's bytes_per_thread
CHUNK_VALUES = 1 << 25  # weights placed at a time (bounds the encoder's scratch memory)


@lru_cache(maxsize=None)
def package_dir() -> Path | None:
    """The installed dfloat11 package's folder, or None (not installed)."""
    spec = importlib.util.find_spec("dfloat11")
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


@lru_cache(maxsize=None)
def utils():
    """The package's dfloat11_utils module (codec, tables and its reference encoder), loaded from
    its file (needs dahuffman, tqdm, numpy, torch)."""
    where = package_dir()
    if where is None:
        raise ImportError("the dfloat11 package is not installed")
    spec = importlib.util.spec_from_file_location("dfloat11_utils", where / "dfloat11_utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exponent_counts(exps: torch.Tensor) -> dict:
    """{exponent: how many weights have it}, ascending, from a histogram on the exponents' device:
    the counter the package's get_codec builds with torch.unique on a CPU copy of the weights."""
    return {e: c for e, c in enumerate(torch.bincount(exps.reshape(-1), minlength=256).tolist()) if c}


def code_table(counter: dict):
    """The package's length-limited Huffman codec (get_32bit_codec, as its compress_model calls it)
    for exponent counts, and its code table."""
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its length-limiting steps
        codec, _, table = utils().get_32bit_codec(counter)
    return codec, table


def encode(w: torch.Tensor, threads: int = THREADS, bytes_per_thread: int = BYTES_PER_THREAD) -> dict:
    """A BF16 tensor in DFloat11's format, the package's bytes (see the module docstring), on w's
    device: {luts, encoded, sign_mantissa, output_positions, gaps, shared_mem, n}."""
    if w.dtype != torch.bfloat16 or w.numel() == 0:
        raise ValueError(f"DFloat11 codes non-empty bfloat16 tensors, got {w.dtype} of {w.numel()} values")
    if bytes_per_thread < 4:  # then a thread's bytes may hold no code's start, which gaps cannot say
        raise ValueError(f"bytes_per_thread must be at least 4 (codes take up to 32 bits), got {bytes_per_thread}")
    dev = w.device
    bits16 = w.reshape(-1).view(torch.int16).to(torch.int32)
    exps = (bits16 >> 7) & 0xFF
    codec, table = code_table(exponent_counts(exps))
    sign_mantissa = (((bits16 >> 8) & 0x80) | (bits16 & 0x7F)).to(torch.uint8)
    lens = torch.zeros(256, dtype=torch.int64)
    vals = torch.zeros(256, dtype=torch.int64)
    for symbol, (nbits, value) in codec._table.items():
        if isinstance(symbol, int):
            lens[symbol], vals[symbol] = nbits, value
    eof_len, eof_val = codec._table[codec._eof]
    lens, vals = lens.to(dev), vals.to(dev)

    n = exps.numel()
    code_len = lens[exps]
    starts = torch.cumsum(code_len, 0) - code_len           # each code's first bit
    total = int(starts[-1] + code_len[-1])
    with_eof = total % 8 != 0                                # the package adds the end-of-file code then
    nbytes = -(-total // 8)
    stream = torch.zeros(nbytes + 5, dtype=torch.int32, device=dev)  # + 5: the last code's window
    for lo in range(0, n, CHUNK_VALUES):
        _place(stream, starts[lo:lo + CHUNK_VALUES], code_len[lo:lo + CHUNK_VALUES], vals[exps[lo:lo + CHUNK_VALUES]])
    if with_eof:
        _place(stream, torch.tensor([total], device=dev), torch.tensor([eof_len], device=dev),
               torch.tensor([eof_val], device=dev))
    encoded = stream[:nbytes].to(torch.uint8)  # the end-of-file code's bits past its first byte are dropped

    all_starts = torch.cat([starts, torch.tensor([total], device=dev)]) if with_eof else starts
    last = int(all_starts[-1])
    thread_bits, block_bits = 8 * bytes_per_thread, 8 * bytes_per_thread * threads
    chunk_at = torch.arange(last // thread_bits + 1, device=dev, dtype=torch.int64) * thread_bits
    gaps = all_starts[torch.searchsorted(all_starts, chunk_at)] - chunk_at
    blocks = math.ceil(nbytes / (threads * bytes_per_thread))
    gap_list = torch.zeros(threads * blocks, dtype=torch.int64, device=dev)
    gap_list[:gaps.numel()] = gaps
    gap_bits = (gap_list[:, None] >> torch.arange(4, -1, -1, device=dev)) & 1  # 5 bits each, MSB first
    packed_gaps = torch.from_numpy(np.packbits(gap_bits.reshape(-1).to(torch.uint8).cpu().numpy()))

    block_at = torch.arange(last // block_bits + 1, device=dev, dtype=torch.int64) * block_bits
    positions = torch.cat([torch.searchsorted(all_starts, block_at), torch.tensor([n], device=dev)])
    output_positions = positions.to(torch.int32)  # < 2^31 weights: the package's uint32 bits
    span = int((positions[1:] - positions[:-1]).max())
    with contextlib.redirect_stdout(io.StringIO()):  # it prints each table
        luts = utils().get_luts(table)
    return {"luts": luts.to(dev), "encoded": encoded, "sign_mantissa": sign_mantissa,
            "output_positions": output_positions.view(torch.uint8), "gaps": packed_gaps.to(dev),
            "shared_mem": threads * 4 + 4 + span * 2, "n": n, "threads": threads, "bytes_per_thread": bytes_per_thread}


def _place(stream: torch.Tensor, starts, lens, values) -> None:
    """Add each code (value, its lens[i] bits) to the byte stream at bit starts[i], MSB first.
    Codes never share a bit, so adding the bytes is or-ing them."""
    shift = 40 - (starts & 7) - lens           # the code inside a 5-byte window at its first byte
    window = values << shift
    first = starts >> 3
    for k in range(5):
        stream.index_add_(0, first + k, ((window >> (32 - 8 * k)) & 0xFF).to(torch.int32))


def reference_encode(w: torch.Tensor, threads: int, bytes_per_thread: int) -> dict:
    """The package's own encoder (dfloat11_utils.encode_weights) on the CPU: the oracle of the
    tests, for small tensors (a Python loop a weight)."""
    u = utils()
    _, counter = u.get_codec(w.reshape(-1).cpu())  # the package's own count, not exponent_counts
    codec, _ = code_table(counter)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress
        encoded, sign_mantissa, output_positions, gaps, _ = u.encode_weights([w.reshape(-1).cpu()], codec,
                                                                             bytes_per_thread, threads)
    return {"encoded": encoded, "sign_mantissa": sign_mantissa, "output_positions": output_positions.view(torch.uint8),
            "gaps": gaps}


@lru_cache(maxsize=None)
def _kernel(device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(path=str(package_dir() / "decode.ptx")).get_function("decode")


def decode(state: dict, out: torch.Tensor) -> None:
    """DFloat11's kernel: out (n BF16 on the state's GPU) = the weights, on torch's current stream."""
    import cupy

    dev = state["encoded"].device
    fn = _kernel(dev.index)
    n_bytes = state["encoded"].numel()
    grid = (math.ceil(n_bytes / (state["threads"] * state["bytes_per_thread"])),)
    with cupy.cuda.Device(dev.index), cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream, dev.index):
        fn(grid, (state["threads"],), (state["luts"].data_ptr(), state["encoded"].data_ptr(),
                                       state["sign_mantissa"].data_ptr(), state["output_positions"].data_ptr(),
                                       state["gaps"].data_ptr(), out.data_ptr(), np.uint32(state["luts"].shape[0]),
                                       np.uint32(n_bytes), np.uint32(state["n"])), shared_mem=state["shared_mem"])


def nbytes(state: dict) -> int:
    """Bytes of the format's arrays (what DFloat11 keeps in GPU memory)."""
    return sum(state[k].numel() * state[k].element_size()
               for k in ("luts", "encoded", "sign_mantissa", "output_positions", "gaps"))
