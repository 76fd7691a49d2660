"""What each kind of node costs in a replayed CUDA graph (development aid, any CUDA GPU).

    python benchmarks/graph_nodes.py

A fast-path call is one small graph (kvzip/gpu/graphs.py): table upload, two to four kernels,
a download of a few bytes.  This replays graphs made of those pieces alone, with kernels that do
nothing, and prints the median time of each (CUDA events around the launch, 400 replays), so the
difference between two lines is what a node costs.  The last lines are the copy nodes' stand-in:
a kernel reading and writing pinned host memory through its mapped address.
"""
import cupy
import cupyx
import numpy as np

_SOURCE = r"""
extern "C" __global__ void nop(unsigned long long* p) { if (p && threadIdx.x == 0 && blockIdx.x == 0) p[0] += 1; }
extern "C" __global__ void touch(const unsigned long long* in, unsigned long long* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = in[0] + 1;
}
"""


def main(replays=400):
    mod = cupy.RawModule(code=_SOURCE)
    nop, touch = mod.get_function("nop"), mod.get_function("touch")
    dev = cupy.zeros(1 << 16, np.uint64)
    host_up, host_down = cupyx.zeros_pinned(4096, np.uint8), cupyx.zeros_pinned(64, np.uint8)
    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    grid = (cupy.cuda.Device().attributes["MultiProcessorCount"] * 3,)  # a dense kernel's grid
    d = np.uint64(dev.data.ptr)

    def kernel(s, n=1):
        for _ in range(n):
            nop(grid, (256,), (d,), stream=s)

    def upload(s):
        rt.memcpyAsync(dev.data.ptr, host_up.ctypes.data, 2048, 1, s.ptr)

    def download(s):
        rt.memcpyAsync(host_down.ctypes.data, dev.data.ptr, 64, 2, s.ptr)

    cases = {
        "1 kernel": kernel,
        "2 kernels": lambda s: kernel(s, 2),
        "4 kernels": lambda s: kernel(s, 4),
        "memset 4 KiB + kernel": lambda s: (rt.memsetAsync(dev.data.ptr, 0, 4096, s.ptr), kernel(s)),
        "copy 2 KiB to device + kernel": lambda s: (upload(s), kernel(s)),
        "kernel + copy 64 B to host": lambda s: (kernel(s), download(s)),
        "copy + kernel + copy": lambda s: (upload(s), kernel(s), download(s)),
        "copy + 3 kernels + copy": lambda s: (upload(s), kernel(s, 3), download(s)),
        "kernel reading and writing pinned memory": lambda s: touch(
            grid, (256,), (np.uint64(host_up.ctypes.data), np.uint64(host_down.ctypes.data)), stream=s),
    }
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: graph replay, median of {replays}")
    for name, issue in cases.items():
        side = cupy.cuda.Stream(non_blocking=True)
        side.begin_capture()
        issue(side)
        graph = side.end_capture()
        times = []
        for i in range(replays + 20):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            b.synchronize()
            if i >= 20:
                times.append(cupy.cuda.get_elapsed_time(a, b) * 1000)
        print(f"  {name:<44} {np.median(times):7.2f} us")
    host_up.view(np.uint64)[0] = 41
    touch((1,), (32,), (np.uint64(host_up.ctypes.data), np.uint64(host_down.ctypes.data)), stream=stream)
    stream.synchronize()
    assert host_down.view(np.uint64)[0] == 42, "a kernel could not reach pinned memory through its address"


if __name__ == "__main__":
    main()
