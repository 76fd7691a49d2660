"""The weights' kernels on a real GPU against the tiled layout's reference (kvzip/weights/tiled.py):
the GPU encoder writes the CPU's bytes, kvz_w_decode + kvz_w_patch give W back bit for bit, and
kvz_w_gemm (ZipLinear's fused forward) and kvz_w_gemm_wide (tiled_linear above N = 32) agree
with an FP32 product within BF16 rounding, the same in every call, in CUDA graphs too, with the
split counters left at zero."""
import pytest
import torch
import torch.nn.functional as F

import cupy  # noqa: F401  (tests/conftest.py collects tests/gpu only where CuPy sees a GPU)

import kvzip.weights as kw
from kvzip.testing import weight_matrix
from kvzip.weights import tiled

CUDA = torch.device("cuda")


def weights(m, k, seed=0, spread=1.0, zeros=0.0):
    """Student-t weights with per-row scales (like trained matrices); spread widens the rows'
    scales (more exponents: escapes), zeros sets that share of exact zeros."""
    torch.manual_seed(seed)
    w = torch.distributions.StudentT(5.0).sample((m, k)) * torch.exp(torch.randn(m, 1) * 0.3 * spread) * 0.02
    if zeros:
        w[torch.rand(m, k) < zeros] = 0
    return w.to(torch.bfloat16)


SHAPES = [(1, 2), (16, 64), (17, 66), (100, 130), (384, 384), (1000, 4096), (4096, 1024), (48, 6)]


@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_encoder_writes_the_cpu_bytes(shape):
    w = weights(*shape, spread=3.0)
    a, b = tiled.encode(w), tiled.encode(w.to(CUDA))
    for x, y in zip(a.arrays(), b.arrays()):
        assert torch.equal(x, y.cpu())


# The encoder's paths (kvz_w_histogram's codebook block, kvz_w_encode's offsets block, kvz_w_escapes'
# starts within a band): no escape (no kvz_w_escapes launch), escapes in some bands only, escapes
# everywhere; ragged and tiny shapes; bands over many warps of the offsets' scan (1100, 4800 rows),
# several thread blocks a band's escapes (K = 4096), the shapes.
@pytest.mark.parametrize("m,k,kind", [(48, 192, "clean"), (1, 1, "clean"), (1024, 4096, "clean"), (80, 300, "bands"),
                                      (70, 129, "bands"), (1, 2, "bits"), (5, 7, "bits"), (64, 640, "bits"),
                                      (4800, 5, "bits"), (1024, 4096, "bits"), (4096, 4096, "bits"), (1100, 3, "bands")])
def test_gpu_encoder_paths_write_the_cpu_bytes(m, k, kind):
    w = weight_matrix(m, k, kind)
    a = tiled.encode(w)
    assert (a.escapes == 0) == (kind == "clean" or m * k < 16)
    for _ in range(2):  # a fresh workspace each call
        b = tiled.encode(w.to(CUDA))
        for x, y in zip(a.arrays(), b.arrays()):
            assert torch.equal(x, y.cpu())


def test_gpu_encoder_on_a_side_stream():
    w = weights(1024, 4096, seed=3, spread=3.0)
    a, d = tiled.encode(w), w.to(CUDA)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        b = tiled.encode(d)
    for x, y in zip(a.arrays(), b.arrays()):
        assert torch.equal(x, y.cpu())


@pytest.mark.parametrize("shape", SHAPES + [(33, 65), (5, 127)])
@pytest.mark.parametrize("spread", [1.0, 6.0])
def test_decode_kernel_is_exact(shape, spread):
    w = weights(*shape, seed=1, spread=spread, zeros=0.01)
    zl = kw.ZipLinear(tiled.encode(w.to(CUDA)))
    assert spread == 1.0 or shape[0] * shape[1] < 1000 or zl.tiled.escapes > 0
    got = zl.decompress_weight()
    assert torch.equal(got.view(torch.int16).cpu(), w.view(torch.int16))


def test_decode_kernel_every_bit_pattern():
    bits = torch.randint(-32768, 32768, (64, 640), dtype=torch.int32).to(torch.int16)
    w = bits.view(torch.bfloat16)
    zl = kw.ZipLinear(tiled.encode(w.to(CUDA)))
    assert torch.equal(zl.decompress_weight().view(torch.int16).cpu(), bits)


def assert_close_to_fp32(y, x, w, bias=None):
    """y within BF16 rounding of the FP32 product x w^T + bias: half a BF16 ulp of the output
    (2^-8 relative) plus what FP32 summation in another order may differ by (2^-20 of the sum
    of the terms' magnitudes)."""
    x, w = x.float().cpu(), w.float().cpu()
    ref = x @ w.T + (0 if bias is None else bias.float().cpu())
    tol = ref.abs() * 2.0 ** -8 + 2.0 ** -20 * (x.abs() @ w.abs().T + (0 if bias is None else bias.float().abs().cpu()))
    err = (y.float().cpu() - ref).abs()
    assert bool((err <= tol).all()), float((err - tol).max())


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 16, 17, 31, 32, 33, 64])  # 33, 64: decode + cuBLAS
@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 4096), (300, 770), (304, 784), (16, 64)])
def test_fused_gemm_against_fp32(n, shape):
    m, k = shape
    w = weights(m, k, seed=n, spread=4.0)
    bias = torch.randn(m).to(torch.bfloat16)
    lin = torch.nn.Linear(k, m, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(bias)
    zl = kw.ZipLinear.from_linear(lin).to(CUDA)
    assert zl.tiled.escapes > 0 or m * k < 5000
    x = torch.randn(n, k).to(torch.bfloat16).to(CUDA)
    y = zl(x)
    assert y.dtype == torch.bfloat16 and y.shape == (n, m)
    if k % 16 or n > zl.route_n:  # W decoded, then torch's own product: exactly nn.Linear's
        assert torch.equal(y, F.linear(x, w.to(CUDA), bias.to(CUDA)))
    else:
        assert_close_to_fp32(y, x, w, bias)
    assert torch.equal(zl(x), y)  # the same bits every call (the split sums in a fixed order)
    assert int(zl.tickets.abs().sum()) == 0


def test_leading_dimensions_and_wide_x_route_to_cublas():
    m, k = 512, 1024
    w = weights(m, k, seed=5)
    zl = kw.ZipLinear(tiled.encode(w.to(CUDA)))
    for shape in [(2, 3, k), (200, k), (1, 1, 1, k)]:
        x = torch.randn(*shape).to(torch.bfloat16).to(CUDA)
        y = zl(x)
        assert y.shape == (*shape[:-1], m)
        if x.numel() // k > zl.route_n:
            assert torch.equal(y, F.linear(x, w.to(CUDA)))
        else:
            assert_close_to_fp32(y.reshape(-1, m), x.reshape(-1, k), w)


def wide_linear(zl, x, bias=None):
    """tiled_linear's product for any N: kvz_w_gemm_wide above 32, which ZipLinear does not route
    to yet (benchmarks/NOTES.md w8)."""
    return kw.tiled_linear(x, zl.blocks, zl.codebook, zl.esc_off, zl.esc_pos, zl.esc_val, bias, zl.tickets,
                           zl.out_features, zl.in_features)


@pytest.mark.parametrize("n", [33, 64, 65, 100, 128, 129, 200, 256, 300])
@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 4096), (304, 784), (16, 64), (136, 192)])
def test_wide_kernel_against_fp32(n, shape):
    """kvz_w_gemm_wide (tiled_linear above N = 32): within BF16 rounding of the FP32 product, bias
    and escapes included, the same bits every call, the tickets zero again."""
    m, k = shape
    w = weights(m, k, seed=n, spread=4.0)
    bias = torch.randn(m).to(torch.bfloat16).to(CUDA)
    zl = kw.ZipLinear(tiled.encode(w.to(CUDA)))
    assert zl.tiled.escapes > 0 or m * k < 5000
    x = torch.randn(n, k).to(torch.bfloat16).to(CUDA)
    y = wide_linear(zl, x, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (n, m)
    assert_close_to_fp32(y, x, w, bias.cpu())
    assert torch.equal(wide_linear(zl, x, bias), y)
    assert int(zl.tickets.abs().sum()) == 0


@pytest.mark.parametrize("n", [4, 100])  # kvz_w_gemm, kvz_w_gemm_wide
def test_graph_capture_replays_the_eager_result(n):
    m, k = 2048, 2048
    zl = kw.ZipLinear(tiled.encode(weights(m, k, seed=7).to(CUDA)))
    x = torch.randn(n, k).to(torch.bfloat16).to(CUDA)
    product = zl if n <= zl.route_n else (lambda v: wide_linear(zl, v))
    eager = product(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        product(x)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(torch.randn(n, k).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, product(x))


def test_odd_k_takes_the_decoding_path():
    w = weights(40, 77, seed=9)
    zl = kw.ZipLinear(tiled.encode(w)).to(CUDA)
    x = torch.randn(3, 77).to(torch.bfloat16).to(CUDA)
    assert torch.equal(zl(x), F.linear(x, w.to(CUDA)))  # K odd: W decoded, then torch's product


def test_torch_compile_sees_the_custom_op():
    zl = kw.ZipLinear(tiled.encode(weights(256, 512, seed=11).to(CUDA)))
    x = torch.randn(2, 512).to(torch.bfloat16).to(CUDA)
    compiled = torch.compile(zl, fullgraph=True)
    assert torch.equal(compiled(x), zl(x))
