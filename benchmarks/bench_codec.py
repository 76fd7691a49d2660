"""GPU codec benchmark: kvzip vs the device-copy roofline and nvCOMP on real KV data.

    python benchmarks/bench_codec.py [--values-log2 28] [--repeat 20] [--out benchmarks/results]

The same as `kvzip bench`; the code lives in kvzip/bench.py so the installed package can run it.
Writes benchmarks/results/<gpu>.json and .png (committed from a real run).
"""
import sys

from kvzip.bench import main

if __name__ == "__main__":
    sys.exit(main())
