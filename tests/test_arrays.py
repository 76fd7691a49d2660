"""kvzip.arrays: zero-copy import/export of tensors and blobs across frameworks.

CPU tests run everywhere; the JAX tests need jax, the CuPy / torch-CUDA tests a GPU with CuPy.
"""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvzip import FORMATS, get_format
from kvzip.arrays import (Origin, ResultBuffer, export_bytes, export_tensor, export_tensors, framework_of, import_blobs,
                          import_bytes, import_tensor)

torch = pytest.importorskip("torch")

try:
    import jax
    import jax.numpy as jnp
except ImportError:  # pragma: no cover - jax is optional
    jax = jnp = None

try:
    import cupy

    HAVE_CUDA = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # pragma: no cover - no CuPy or no GPU
    cupy, HAVE_CUDA = None, False

def _jax_gpus():
    try:
        return jax.devices("gpu") if jax is not None else []
    except RuntimeError:  # no GPU backend
        return []


needs_jax = pytest.mark.skipif(jax is None, reason="jax not installed")
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs CuPy and a CUDA GPU")
needs_jax_cuda = pytest.mark.skipif(not (HAVE_CUDA and _jax_gpus()), reason="needs jax with CUDA and CuPy")

NP_DTYPE = {
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "fp16": np.dtype(np.float16),
    "fp32": np.dtype(np.float32),
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
TORCH_DTYPE = {name: getattr(torch, f.dtype_name) for name, f in FORMATS.items()}
TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (5, 3), (2, 3, 4, 5, 6)]


def raw_bits(fmt, shape, seed=0):
    """Random bit patterns of a format, every special value included (NaN payloads, +-0, +-Inf,
    subnormals): the raw bits must survive untouched, so the values never matter."""
    n = int(np.prod(shape))
    info = np.iinfo(fmt.uint_dtype)
    bits = np.random.default_rng(seed).integers(0, int(info.max) + 1, n, dtype=np.uint64)
    specials = [0, 1 << (fmt.width - 1), int(info.max), 1]  # +0, -0, a NaN of all ones, a subnormal
    bits[: min(n, len(specials))] = specials[: min(n, len(specials))]
    return bits.astype(fmt.uint_dtype).reshape(shape)


def numpy_tensor(name, shape, seed=0):
    fmt = FORMATS[name]
    return raw_bits(fmt, shape, seed).view(NP_DTYPE[name])


def torch_tensor(name, shape, seed=0):
    fmt = FORMATS[name]
    ints = raw_bits(fmt, shape, seed).view(str(TORCH_INT[fmt.itemsize]).removeprefix("torch."))
    return torch.from_numpy(ints.copy()).view(TORCH_DTYPE[name])


def cupy_holds(name):
    """fp16/fp32 always; bf16 from CuPy 14; float8 not yet."""
    try:
        cupy.empty(0, NP_DTYPE[name])
    except (TypeError, ValueError):
        return False
    return True


def jax_cpu(a):
    """A JAX array on the CPU even where JAX's default device is a GPU."""
    return jax.device_put(a, jax.devices("cpu")[0])


def bits_of_torch(t):
    """Expected bits of a torch tensor, computed independently of kvzip."""
    fmt = get_format(t.dtype)
    return t.contiguous().view(TORCH_INT[fmt.itemsize]).numpy().ravel().view(fmt.uint_dtype)


# --------------------------------------------------------------------------------------- numpy


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_numpy_round_trip_is_zero_copy(name, shape):
    x = numpy_tensor(name, shape)
    bits, fmt, got_shape, origin = import_tensor(x)
    assert fmt is FORMATS[name] and got_shape == shape
    assert origin == Origin("numpy", "cpu", None) and origin.backend_name == "cpu"
    assert bits.ndim == 1 and bits.dtype == fmt.uint_dtype and bits.flags.c_contiguous
    np.testing.assert_array_equal(bits, x.view(fmt.uint_dtype).ravel())
    if x.size:
        assert np.shares_memory(bits, x)
    y = export_tensor(bits, fmt, shape, origin)
    assert type(y) is np.ndarray and y.dtype == x.dtype and y.shape == shape
    np.testing.assert_array_equal(y.view(fmt.uint_dtype), x.view(fmt.uint_dtype))
    if x.size:
        assert np.shares_memory(y, bits)


def test_numpy_view_aliases_the_caller_memory():
    x = numpy_tensor("bf16", (4, 8))
    bits, *_ = import_tensor(x)
    x[0, 0] = 1.0
    assert bits[0] == 0x3F80  # bf16 1.0, seen through the view


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize(
    "view",
    [lambda a: a.T, lambda a: a[::2], lambda a: a[:, 1::3], lambda a: a[::-1, ::-2],
     lambda a: a.transpose(2, 0, 1)[..., 1], lambda a: np.broadcast_to(a[:1], (3,) + a.shape[1:])],
    ids=["T", "step", "colstep", "reversed", "permute", "broadcast"],
)
def test_numpy_non_contiguous_views(name, view):
    base = numpy_tensor(name, (6, 7, 3))
    x = view(base)
    before = base.copy()
    bits, fmt, shape, origin = import_tensor(x)
    assert shape == x.shape and bits.flags.c_contiguous
    np.testing.assert_array_equal(bits, np.ascontiguousarray(x).view(fmt.uint_dtype).ravel())
    np.testing.assert_array_equal(base.view(fmt.uint_dtype), before.view(fmt.uint_dtype))
    y = export_tensor(bits, fmt, shape, origin)
    np.testing.assert_array_equal(y.view(fmt.uint_dtype), np.ascontiguousarray(x).view(fmt.uint_dtype))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_numpy_any_strided_view_round_trips(data):
    name = data.draw(st.sampled_from(list(FORMATS)))
    fmt = FORMATS[name]
    base = numpy_tensor(name, data.draw(hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=5)))
    x = base[data.draw(hnp.basic_indices(base.shape, allow_newaxis=True))]
    x = x.transpose(data.draw(st.permutations(range(x.ndim))))
    bits, got, shape, origin = import_tensor(x)
    expected = np.array(x, order="C").view(fmt.uint_dtype)  # ascontiguousarray makes 0-d 1-d
    assert got is fmt and shape == x.shape and bits.flags.c_contiguous
    assert np.array_equal(bits, expected.ravel())
    if isinstance(x, np.ndarray) and x.flags.c_contiguous and x.size:  # base[()] is a scalar, not a view
        assert np.shares_memory(bits, x)
    assert np.array_equal(export_tensor(bits, fmt, shape, origin).view(fmt.uint_dtype), expected)


def test_numpy_scalar_and_memmap(tmp_path):
    bits, fmt, shape, _ = import_tensor(np.float32(1.5))
    assert (fmt.name, shape, bits.tolist()) == ("fp32", (), [0x3FC00000])
    mm = np.memmap(tmp_path / "x", dtype=np.float16, mode="w+", shape=(4, 4))
    mm[:] = 2.0
    bits, fmt, shape, origin = import_tensor(mm)
    assert fmt.name == "fp16" and shape == (4, 4) and np.shares_memory(bits, mm)
    assert (bits == 0x4000).all()


# --------------------------------------------------------------------------------------- torch


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_round_trip_is_zero_copy(name, shape):
    t = torch_tensor(name, shape)
    bits, fmt, got_shape, origin = import_tensor(t)
    assert fmt is FORMATS[name] and got_shape == shape
    assert origin == Origin("torch", "cpu", None)
    assert isinstance(bits, np.ndarray) and bits.ndim == 1 and bits.dtype == fmt.uint_dtype
    assert bits.flags.c_contiguous
    np.testing.assert_array_equal(bits, bits_of_torch(t))
    if t.numel():
        assert bits.ctypes.data == t.data_ptr()
    y = export_tensor(bits, fmt, shape, origin)
    assert isinstance(y, torch.Tensor) and y.dtype == t.dtype and tuple(y.shape) == shape
    assert y.device.type == "cpu"
    np.testing.assert_array_equal(bits_of_torch(y), bits_of_torch(t))
    if t.numel():
        assert y.data_ptr() == bits.ctypes.data


def test_torch_view_aliases_the_caller_memory():
    t = torch.zeros(3, 5, dtype=torch.bfloat16)
    bits, *_ = import_tensor(t)
    t[2, 4] = -2.0
    assert bits[-1] == 0xC000


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize(
    "view",
    [lambda t: t.t(), lambda t: t[::2], lambda t: t[:, 1::3], lambda t: t.unsqueeze(0).expand(3, -1, -1),
     lambda t: t.reshape(2, 3, 7).permute(2, 0, 1)],
    ids=["t", "step", "colstep", "expand", "permute"],
)
def test_torch_non_contiguous_views(name, view):
    base = torch_tensor(name, (6, 7))
    x = view(base)
    assert not x.is_contiguous()
    bits, fmt, shape, origin = import_tensor(x)
    assert shape == tuple(x.shape) and bits.flags.c_contiguous
    np.testing.assert_array_equal(bits, bits_of_torch(x))
    y = export_tensor(bits, fmt, shape, origin)
    np.testing.assert_array_equal(bits_of_torch(y), bits_of_torch(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_requires_grad(dtype):
    w = torch.nn.Parameter(torch.linspace(-3, 3, 12, dtype=dtype).reshape(3, 4))
    assert framework_of(w) == "torch"
    bits, fmt, shape, origin = import_tensor(w)
    assert bits.ctypes.data == w.data_ptr()
    y = export_tensor(bits, fmt, shape, origin)
    assert torch.equal(y, w.detach()) and not y.requires_grad


def test_torch_five_d_permuted():
    base = torch_tensor("bf16", (2, 3, 4, 5, 6), seed=3)
    x = base.permute(4, 2, 0, 3, 1)[::2]
    bits, fmt, shape, origin = import_tensor(x)
    np.testing.assert_array_equal(bits, bits_of_torch(x))
    assert torch.equal(export_tensor(bits, fmt, shape, origin).view(torch.int16), x.contiguous().view(torch.int16))


# ----------------------------------------------------------------------------- dtype override


@pytest.mark.parametrize(
    "dtype",
    ["bf16", "bfloat16", ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16), torch.bfloat16, FORMATS["bf16"]],
    ids=["short", "long", "ml_dtypes", "np.dtype", "torch", "FloatFormat"],
)
def test_dtype_override_spellings(dtype):
    raw = raw_bits(FORMATS["bf16"], (4, 5))
    bits, fmt, shape, origin = import_tensor(raw, dtype=dtype)
    assert fmt.name == "bf16" and shape == (4, 5) and np.shares_memory(bits, raw)
    y = export_tensor(bits, fmt, shape, origin)
    assert y.dtype == NP_DTYPE["bf16"]
    np.testing.assert_array_equal(y.view(np.uint16), raw)


@pytest.mark.parametrize("name", list(FORMATS))
def test_dtype_override_numpy_and_torch_raw_bits(name):
    fmt = FORMATS[name]
    raw = raw_bits(fmt, (3, 4))
    bits, got, shape, _ = import_tensor(raw, dtype=name)
    assert got is fmt and np.shares_memory(bits, raw)
    # torch integers of the same width, signed or not, hold the bits too
    t = torch.from_numpy(raw.view(np.dtype(f"int{fmt.width}")).copy())
    bits, got, shape, origin = import_tensor(t, dtype=TORCH_DTYPE[name])
    assert got is fmt and bits.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(bits, raw.ravel())
    y = export_tensor(bits, got, shape, origin)
    assert y.dtype == TORCH_DTYPE[name]


def test_dtype_override_numpy_scalar_type_and_same_width_float():
    bits, fmt, *_ = import_tensor(np.zeros(3, np.int16), dtype=np.float16)
    assert fmt.name == "fp16"
    bits, fmt, *_ = import_tensor(np.ones(3, np.float16), dtype="bf16")  # reinterpretation, not conversion
    assert fmt.name == "bf16" and (bits == 0x3C00).all()


@pytest.mark.parametrize(
    "x, dtype",
    [(np.zeros(4, np.uint8), "bf16"), (np.zeros(4, np.uint32), "bf16"), (np.zeros(4, np.uint16), "fp32"),
     (np.zeros(4, np.float64), "fp32"), (np.zeros(4, bool), "e4m3"), (np.zeros(2, np.complex64), "fp32"),
     (torch.zeros(4, dtype=torch.int32), torch.bfloat16), (torch.zeros(4, dtype=torch.bool), "e5m2")],
)
def test_dtype_override_mismatch_is_type_error(x, dtype):
    with pytest.raises(TypeError):
        import_tensor(x, dtype=dtype)


def test_dtype_override_unknown_format():
    with pytest.raises(TypeError, match="supports"):
        import_tensor(np.zeros(4, np.uint16), dtype="int4")


# --------------------------------------------------------------------------------- type errors


@pytest.mark.parametrize(
    "x",
    [np.zeros(3, np.int32), np.zeros(3, np.float64), np.zeros(3, np.complex64), np.zeros(3, bool),
     np.array([None]), np.zeros(3, np.uint16), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.float64),
     torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.complex64), torch.zeros(3, dtype=torch.uint16)],
    ids=lambda x: f"{framework_of(x)}-{x.dtype}",
)
def test_unsupported_dtypes_list_the_supported_formats(x):
    with pytest.raises(TypeError, match=r"supported formats are bf16 \(bfloat16\).*e5m2"):
        import_tensor(x)


def test_raw_bits_without_dtype_hint():
    with pytest.raises(TypeError, match="dtype="):
        import_tensor(np.zeros(3, np.uint16))


@pytest.mark.parametrize("x", [[1.0, 2.0], b"\x00\x01", 3.0, "bf16", object()], ids=type)
def test_non_arrays_are_type_errors(x):
    with pytest.raises(TypeError):
        import_tensor(x)


def test_torch_sparse_is_type_error():
    with pytest.raises(TypeError, match="dense"):
        import_tensor(torch.zeros(3, 3).to_sparse())


# ---------------------------------------------------------------------------- other objects


class ArrayInterfaceOnly:
    def __init__(self, a):
        self.__array_interface__ = a.__array_interface__
        self._keep = a


class DLPackOnly:
    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.parametrize("wrap", [ArrayInterfaceOnly, DLPackOnly])
def test_foreign_objects_go_through_numpy(wrap):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    bits, fmt, shape, origin = import_tensor(wrap(a))
    assert framework_of(wrap(a)) is None
    assert (fmt.name, shape, origin) == ("fp32", (3, 4), Origin("numpy"))
    assert np.shares_memory(bits, a)
    np.testing.assert_array_equal(export_tensor(bits, fmt, shape, origin), a)


def test_framework_of():
    assert framework_of(np.zeros(1)) == "numpy"
    assert framework_of(np.float16(1)) == "numpy"
    assert framework_of(torch.zeros(1)) == "torch"
    assert framework_of(torch.nn.Parameter(torch.zeros(1))) == "torch"
    assert framework_of(b"") is None and framework_of([1]) is None

    class MyTensor(torch.Tensor):  # a subclass from another module
        pass

    assert framework_of(torch.zeros(2).as_subclass(MyTensor)) == "torch"


def test_origin_is_frozen_and_cpu_stream_context_is_a_no_op():
    origin = Origin("torch", "cpu", None)
    with pytest.raises(AttributeError):
        origin.framework = "numpy"
    assert hash(origin) == hash(Origin("torch"))
    with origin.stream_context():
        pass
    assert Origin("cupy", "cuda", 1).backend_name == "cuda"


def test_no_framework_is_imported_for_numpy_callers():
    code = (
        "import sys, numpy as np\n"
        "from kvzip.arrays import import_tensor, export_tensor, import_bytes, export_bytes\n"
        "b, f, s, o = import_tensor(np.zeros((2, 3), np.float16))\n"
        "export_tensor(b, f, s, o)\n"
        "u, o = import_bytes(b'abc'); export_bytes(u, o)\n"
        "loaded = [m for m in ('torch', 'cupy', 'jax') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------- jax


@needs_jax
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_jax_cpu_round_trip(name, shape):
    x = jax_cpu(numpy_tensor(name, shape))
    fmt = FORMATS[name]
    bits, got, got_shape, origin = import_tensor(x)
    assert got is fmt and got_shape == shape and origin == Origin("jax", "cpu", None)
    assert isinstance(bits, np.ndarray) and bits.dtype == fmt.uint_dtype and bits.flags.c_contiguous
    np.testing.assert_array_equal(bits, np.asarray(x).view(fmt.uint_dtype).ravel())
    if x.size:
        assert bits.ctypes.data == x.unsafe_buffer_pointer()  # jax's own buffer, no copy
    y = export_tensor(bits, fmt, shape, origin)
    assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.shape == shape
    np.testing.assert_array_equal(np.asarray(y).view(fmt.uint_dtype), np.asarray(x).view(fmt.uint_dtype))


@needs_jax
def test_jax_dtype_override_and_type_errors():
    raw = jax_cpu(raw_bits(FORMATS["bf16"], (3, 4)))
    bits, fmt, shape, origin = import_tensor(raw, dtype=jnp.bfloat16)
    assert fmt.name == "bf16"
    assert export_tensor(bits, fmt, shape, origin).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="supported formats"):
        import_tensor(jax_cpu(np.zeros(3, np.int32)))
    with pytest.raises(TypeError):
        import_tensor(jax_cpu(np.zeros(3, np.uint8)), dtype="bf16")


# --------------------------------------------------------------------------------------- bytes


PAYLOAD = bytes(range(256)) * 3 + b"kvzip"


def _blob_variants():
    arr = np.frombuffer(PAYLOAD, np.uint8)
    yield "bytes", PAYLOAD, "numpy"
    yield "bytearray", bytearray(PAYLOAD), "numpy"
    yield "memoryview", memoryview(PAYLOAD), "numpy"
    yield "numpy", arr.copy(), "numpy"
    yield "torch", torch.from_numpy(arr.copy()), "torch"
    if jax is not None:
        yield "jax", jax_cpu(arr), "jax"


@pytest.mark.parametrize("label, blob, framework", list(_blob_variants()), ids=lambda v: v if isinstance(v, str) else "")
def test_bytes_round_trip(label, blob, framework):
    u8, origin = import_bytes(blob)
    assert isinstance(u8, np.ndarray) and u8.dtype == np.uint8 and u8.ndim == 1 and u8.flags.c_contiguous
    assert u8.tobytes() == PAYLOAD
    assert origin == Origin(framework)
    out = export_bytes(u8, origin)
    assert framework_of(out) == framework
    assert np.asarray(out).tobytes() == PAYLOAD
    # a fresh result (what decode produces) goes back into the caller's framework
    fresh = export_bytes(np.frombuffer(b"\x01\x02\x03", np.uint8).copy(), origin)
    assert framework_of(fresh) == framework and np.asarray(fresh).tolist() == [1, 2, 3]


def test_bytes_are_viewed_in_place():
    arr = np.frombuffer(PAYLOAD, np.uint8).copy()
    assert np.shares_memory(import_bytes(arr)[0], arr)
    buf = bytearray(PAYLOAD)
    u8, _ = import_bytes(buf)
    buf[0] = 0xAB
    assert u8[0] == 0xAB
    t = torch.from_numpy(arr)
    assert import_bytes(t)[0].ctypes.data == t.data_ptr()


@pytest.mark.parametrize(
    "blob, expected",
    [(np.frombuffer(PAYLOAD, np.uint8)[::3], PAYLOAD[::3]),
     (torch.from_numpy(np.frombuffer(PAYLOAD, np.uint8).copy())[1::2], PAYLOAD[1::2]),
     (memoryview(PAYLOAD)[::2], PAYLOAD[::2])],
    ids=["numpy", "torch", "memoryview"],
)
def test_non_contiguous_blobs_are_copied(blob, expected):
    u8, _ = import_bytes(blob)
    assert u8.flags.c_contiguous and u8.tobytes() == expected


def test_typed_python_buffers_are_bytes():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    u8, origin = import_bytes(memoryview(a))
    assert u8.tobytes() == a.tobytes() and origin == Origin("numpy")
    assert import_bytes(b"")[0].size == 0


@pytest.mark.parametrize(
    "blob",
    [np.zeros(4, np.int8), np.zeros(4, np.uint16), np.zeros((2, 2), np.uint8), np.zeros((), np.uint8),
     torch.zeros(4, dtype=torch.int8), torch.zeros((2, 2), dtype=torch.uint8), torch.zeros(4, dtype=torch.bfloat16),
     [1, 2, 3], 7],
    ids=lambda b: type(b).__name__,
)
def test_bad_blobs_are_type_errors(blob):
    with pytest.raises(TypeError):
        import_bytes(blob)


@needs_jax
def test_bad_jax_blob_is_type_error():
    with pytest.raises(TypeError):
        import_bytes(jax_cpu(np.zeros((2, 2), np.uint8)))


def test_torch_export_of_read_only_bytes_never_aliases_them():
    data = bytes(16)
    u8, _ = import_bytes(data)
    t = export_bytes(u8, Origin("torch"))
    t[0] = 99  # would corrupt an immutable bytes object if it aliased it
    assert data[0] == 0


# ---------------------------------------------------------------------------------------- CUDA


@needs_cuda
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("shape", [(), (0,), (5, 3), (2, 3, 4, 5, 6)])
def test_cupy_round_trip(name, shape):
    fmt = FORMATS[name]
    raw = cupy.asarray(raw_bits(fmt, shape))
    x = raw.view(NP_DTYPE[name]) if cupy_holds(name) else raw  # else pass the format by name
    bits, got, got_shape, origin = import_tensor(x, dtype=None if x is not raw else name)
    assert got is fmt and got_shape == shape and origin == Origin("cupy", "cuda", raw.device.id)
    assert isinstance(bits, cupy.ndarray) and bits.dtype == fmt.uint_dtype and bits.flags.c_contiguous
    if raw.size:
        assert bits.data.ptr == raw.data.ptr
    y = export_tensor(bits, fmt, shape, origin)
    assert isinstance(y, cupy.ndarray) and y.shape == shape
    assert y.dtype == (NP_DTYPE[name] if cupy_holds(name) else fmt.uint_dtype)
    assert (y.view(fmt.uint_dtype) == raw).all()


# --------------------------------------------------------------------------------------- batches


def test_import_blobs_equals_import_bytes_per_item():
    blobs = [blob for _, blob, _ in _blob_variants()]
    for (u8, origin), blob in zip(import_blobs(blobs), blobs):
        want, worigin = import_bytes(blob)
        assert origin == worigin and u8.tobytes() == want.tobytes()
    with pytest.raises(TypeError):
        import_blobs([PAYLOAD, np.zeros(3, np.uint16)])


@needs_cuda
def test_cupy_and_torch_blob_batches_import_like_single_calls():
    """import_blobs' shortcut for runs of CuPy blobs must give what import_bytes gives, with runs
    broken by a non-contiguous blob, another framework, a bytes object."""
    blobs = [cupy.arange(10, dtype=cupy.uint8), cupy.arange(7, dtype=cupy.uint8), cupy.arange(12, dtype=cupy.uint8)[::2],
             torch.arange(4, dtype=torch.uint8, device="cuda"), PAYLOAD, cupy.arange(3, dtype=cupy.uint8)]
    for (u8, origin), blob in zip(import_blobs(blobs), blobs):
        want, worigin = import_bytes(blob)
        assert origin == worigin and type(u8) is type(want) and bool((cupy.asarray(u8) == cupy.asarray(want)).all())


@needs_cuda
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_export_tensors_equals_export_tensor(framework):
    buffer = cupy.asarray(np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8))
    pieces = [(0, FORMATS["bf16"], (4, 8)), (256, FORMATS["e5m2"], (33,)), (512, FORMATS["fp32"], ()),
              (1024, FORMATS["fp16"], (0, 3))]
    origin = Origin(framework, "cuda", cupy.cuda.runtime.getDevice())
    for got, (at, fmt, shape) in zip(export_tensors(buffer, pieces, origin), pieces):
        n = int(np.prod(shape))
        want = export_tensor(buffer[at:at + n * fmt.itemsize].view(fmt.uint_dtype), fmt, shape, origin)
        assert type(got) is type(want) and got.dtype == want.dtype and tuple(got.shape) == shape
        if framework == "cupy":
            assert bool((got.view(fmt.uint_dtype) == want.view(fmt.uint_dtype)).all())
        else:
            assert torch.equal(got.view(TORCH_INT[fmt.itemsize]), want.view(TORCH_INT[fmt.itemsize]))


def _same(a, b) -> bool:
    """Both None, or arrays of the same type and bytes."""
    if a is None or b is None:
        return a is b
    host = lambda x: x.cpu().numpy() if hasattr(x, "cpu") else x.get() if hasattr(x, "get") else np.asarray(x)  # noqa: E731
    return type(a) is type(b) and host(a).tobytes() == host(b).tobytes()


@needs_cuda
@pytest.mark.parametrize("framework", ["cupy", "torch", "jax"])
def test_result_buffers_hand_out_what_export_gives(framework):
    """A ResultBuffer's blobs and tensors equal export_bytes / export_tensor of the same bytes, in
    the caller's framework; a torch caller's are slices of one torch tensor the kernels wrote
    through the CuPy view."""
    if framework == "jax" and not _jax_gpus():
        pytest.skip("needs jax with CUDA")
    origin = Origin(framework, "cuda", cupy.cuda.runtime.getDevice())
    buf = ResultBuffer(4096, origin)
    buf.array[:] = cupy.asarray(np.random.default_rng(5).integers(0, 256, 4096, dtype=np.uint8))
    raw = buf.array.get()
    starts, lengths = [0, 256, 1024, 4000], [100, None, 0, 96]
    blobs = buf.blobs(starts, lengths)
    assert [_same(a, b) for a, b in zip(blobs, buf.blobs(starts, lengths, buf.places(starts)))] == [True] * 4
    for got, s, n in zip(blobs, starts, lengths):
        if n is None:
            assert got is None
            continue
        want = export_bytes(cupy.asarray(raw[s:s + n]), origin)
        host = got.cpu().numpy() if framework == "torch" else got.get() if framework == "cupy" else np.asarray(got)
        assert type(got) is type(want) and host.tobytes() == raw[s:s + n].tobytes()
    pieces = [(0, FORMATS["bf16"], (4, 8)), (256, FORMATS["e5m2"], (33,)), (512, FORMATS["fp32"], ()),
              (1024, FORMATS["fp16"], (0, 3)), (2048, FORMATS["e4m3"], (2, 2, 2))]
    for got, (at, fmt, shape) in zip(buf.tensors(pieces), pieces):
        n = int(np.prod(shape))
        want = export_tensor(cupy.asarray(raw[at:at + n * fmt.itemsize]).view(fmt.uint_dtype), fmt, shape, origin)
        assert type(got) is type(want) and got.dtype == want.dtype and tuple(got.shape) == shape
        host = got.cpu().view(TORCH_INT[fmt.itemsize]).numpy() if framework == "torch" else np.asarray(
            got.get() if hasattr(got, "get") else got)
        assert host.tobytes() == raw[at:at + n * fmt.itemsize].tobytes()
    if framework == "torch":
        assert buf.tensor.data_ptr() == buf.ptr == buf.array.data.ptr and buf.blobs([8], [8])[0].data_ptr() == buf.ptr + 8


@needs_cuda
def test_torch_cuda_fast_import_edge_cases():
    """The direct (no DLPack) import of contiguous CUDA tensors: grads, a storage offset, one
    value, the memory kept alive by the CuPy view, and a dtype kvzip does not take."""
    x = torch_tensor("bf16", (4, 9)).cuda().requires_grad_()
    bits, fmt, shape, origin = import_tensor(x)
    assert bits.data.ptr == x.data_ptr() and shape == (4, 9) and fmt is FORMATS["bf16"]
    np.testing.assert_array_equal(bits.get(), bits_of_torch(x.detach().cpu()))
    row = x.detach()[2]  # a contiguous view at a storage offset
    bits, *_ = import_tensor(row)
    assert bits.data.ptr == row.data_ptr() and bits.shape == (9,)
    one = torch.tensor(1.5, dtype=torch.float16, device="cuda")
    bits, fmt, shape, _ = import_tensor(one)
    assert shape == () and bits.shape == (1,) and int(bits.get()[0]) == 0x3E00
    t = torch_tensor("fp16", (1000,)).cuda()
    want = bits_of_torch(t.cpu())
    bits, *_ = import_tensor(t)
    del t  # the CuPy view keeps the tensor (and its memory) alive
    torch.cuda.empty_cache()
    np.testing.assert_array_equal(bits.get(), want)
    with pytest.raises(TypeError, match="int64"):
        import_tensor(torch.zeros(3, dtype=torch.int64, device="cuda"))


@needs_cuda
def test_cupy_non_contiguous_and_bytes():
    x = cupy.arange(42, dtype=cupy.float32).reshape(6, 7)
    bits, fmt, shape, origin = import_tensor(x.T[::2])
    assert (bits.view(cupy.float32) == cupy.ascontiguousarray(x.T[::2]).ravel()).all()
    u8, origin = import_bytes(cupy.arange(10, dtype=cupy.uint8))
    assert isinstance(export_bytes(u8, origin), cupy.ndarray)
    with pytest.raises(TypeError):
        import_bytes(cupy.zeros(3, cupy.uint16))


@needs_cuda
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4, 5, 6)])
def test_torch_cuda_round_trip(name, shape):
    t = torch_tensor(name, shape).cuda()
    bits, fmt, got_shape, origin = import_tensor(t)
    assert got_shape == shape and origin == Origin("torch", "cuda", t.device.index)
    assert origin.backend_name == "cuda"
    assert isinstance(bits, cupy.ndarray) and bits.dtype == fmt.uint_dtype
    if t.numel():
        assert bits.data.ptr == t.data_ptr()
    with origin.stream_context():
        assert cupy.cuda.get_current_stream().ptr == torch.cuda.current_stream().cuda_stream
        y = export_tensor(bits, fmt, shape, origin)
    assert y.is_cuda and y.dtype == t.dtype and tuple(y.shape) == shape
    assert torch.equal(y.view(TORCH_INT[fmt.itemsize]), t.view(TORCH_INT[fmt.itemsize]))
    if t.numel():
        assert y.data_ptr() == bits.data.ptr


@needs_cuda
def test_torch_cuda_non_contiguous_side_stream_and_bytes():
    base = torch_tensor("bf16", (6, 7)).cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = base.t()[::2]
        bits, fmt, shape, origin = import_tensor(x)
        with origin.stream_context():
            assert cupy.cuda.get_current_stream().ptr == stream.cuda_stream
            y = export_tensor(bits, fmt, shape, origin)
        assert torch.equal(y.view(torch.int16), x.contiguous().view(torch.int16))
    stream.synchronize()
    blob = torch.arange(10, dtype=torch.uint8, device="cuda")
    u8, origin = import_bytes(blob)
    assert isinstance(u8, cupy.ndarray) and origin == Origin("torch", "cuda", blob.device.index)
    out = export_bytes(u8, origin)
    assert out.is_cuda and torch.equal(out, blob)
    # numpy results (a CPU decode) still come back on the caller's GPU
    out = export_bytes(np.arange(3, dtype=np.uint8), origin)
    assert out.is_cuda and out.tolist() == [0, 1, 2]


@needs_jax_cuda
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4, 5, 6)])
def test_jax_cuda_round_trip(name, shape):
    gpu = _jax_gpus()[0]
    fmt = FORMATS[name]
    x = jax.device_put(numpy_tensor(name, shape), gpu)
    bits, got, got_shape, origin = import_tensor(x)
    assert got is fmt and got_shape == shape and origin == Origin("jax", "cuda", gpu.local_hardware_id)
    assert isinstance(bits, cupy.ndarray) and bits.dtype == fmt.uint_dtype and bits.flags.c_contiguous
    if x.size and cupy_holds(name):  # what CuPy holds crosses DLPack as it is: no copy
        assert bits.data.ptr == x.unsafe_buffer_pointer()
    assert (bits.get() == np.asarray(x).view(fmt.uint_dtype).ravel()).all()
    y = export_tensor(bits, fmt, shape, origin)
    assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.shape == shape and y.devices() == {gpu}
    np.testing.assert_array_equal(np.asarray(y).view(fmt.uint_dtype), np.asarray(x).view(fmt.uint_dtype))
    u8, origin = import_bytes(jax.device_put(np.arange(5, dtype=np.uint8), gpu))
    assert isinstance(u8, cupy.ndarray)
    out = export_bytes(u8, origin)
    assert out.devices() == {gpu} and np.asarray(out).tolist() == [0, 1, 2, 3, 4]


def test_cuda_addresses_refuses_what_is_not_on_a_gpu():
    """arrays.cuda_addresses (a batch's in-place check) gives None for anything but CuPy arrays
    or CUDA torch tensors: NumPy arrays, CPU torch tensors (get_device() is -1), an empty list,
    mixed frameworks.  (The GPU side: tests/gpu/test_real_gpu.py.)"""
    from kvzip import arrays

    host = [np.zeros(64, np.uint16) for _ in range(3)]
    cpu = [torch.zeros(64, dtype=torch.bfloat16) for _ in range(3)]
    for xs in ([], host, cpu, [cpu[0], host[0]], [host[0], cpu[0]]):
        assert arrays.cuda_addresses(xs) is None
