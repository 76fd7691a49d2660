"""Link emulation: a token bucket over the bytes actually sent, for benchmarks on one machine.

A real write (CUDA IPC, TCP, ...) runs at whatever speed it runs; the pacer then holds back the
message's arrival notice until a link of ``gbps`` GB/s would have delivered it.  The link is
modelled as one pipe: message m occupies it for nbytes_m / rate from
start_m = max(ready_m, end of message m-1), where ready_m is when m was written, and m counts as
arrived at max(start_m + nbytes_m / rate, ready_m + its real write time).  So back-to-back
messages keep the link busy exactly as a wire of that rate would, raw transfers measure the
nominal rate (benchmarks/bench_transfer.py checks that), and a real write slower than the
emulated link is never hidden.

This is emulation and is labelled so wherever its figures appear.
"""
from __future__ import annotations

import time


def wait_until(deadline: float) -> None:
    """Sleep, then poll the last 200 us (time.sleep alone overshoots by up to ~100 us), yielding
    the GIL on every poll so the sender's reader thread runs meanwhile."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left - 2e-4 if left > 2e-4 else 0)


class Pacer:
    def __init__(self, gbps: float):
        if not (isinstance(gbps, (int, float)) and gbps > 0):
            raise ValueError(f"link rate must be a positive number of GB/s, got {gbps!r}")
        self.rate = gbps * 1e9
        self._free_at = 0.0

    def arrival(self, nbytes: int, ready: float, written: float) -> float:
        """When a message of nbytes, ready to go at ``ready`` and really written by ``written``
        (perf_counter seconds), reaches the receiver over the emulated link."""
        start = max(ready, self._free_at)
        self._free_at = start + nbytes / self.rate
        return max(self._free_at, written)
