"""Zero-copy import and export of tensors and blobs across NumPy, PyTorch, CuPy and JAX.

The codec works on one thing: a 1-D C-contiguous array of a float format's raw bits
(``FloatFormat.uint_dtype``), a NumPy array on the CPU or a CuPy array on CUDA. This module
turns what the caller holds into such an array, as a view of the caller's memory whenever that
memory is contiguous, and turns results back into the caller's framework on the caller's device.

DLPack carries the memory between frameworks, with two gaps that shape the code:

* NumPy refuses bfloat16 and float8 DLTensors ("Unsupported dtype in DLTensor"), CuPy before
  14 refuses bfloat16, and no CuPy takes float8. A torch tensor of those dtypes is therefore
  reinterpreted as a same-width integer tensor first (``Tensor.view(dtype)``, no copy) and
  crosses as integers, whatever the CuPy version; the way back reinterprets in torch.
* JAX on the CPU hands NumPy its own buffer through ``np.asarray`` (read-only, no copy, any dtype
  including bf16/fp8), which beats ``np.from_dlpack``. On CUDA a JAX array of a dtype CuPy lacks
  must become integers inside JAX (``lax.bitcast_convert_type``), which XLA does as a copy: JAX
  offers no in-place reinterpretation.

CuPy results in a dtype CuPy lacks (float8 always, bf16 before CuPy 14) are their raw unsigned bits.

One shortcut past DLPack: a contiguous CUDA torch tensor is read as a CuPy array over its own
memory (``data_ptr``, the tensor kept alive as the owner), a fraction of what the capsule and
its stream handshake cost; kvzip's work then runs on the caller's
torch stream (``Origin.stream_context``), the same ordering DLPack's handshake gives.

torch, cupy and jax are imported only when the caller's object belongs to them: a NumPy-only
user never pays for (or needs) any of them.
"""
from __future__ import annotations

import contextlib
import math
import re
import sys
from dataclasses import dataclass
from functools import lru_cache, partial
from operator import attrgetter, methodcaller

import numpy as np

from .formats import BY_DTYPE_NAME, FORMATS, FloatFormat, get_format
from .gpu.results import DeviceBuffer

__all__ = ["Origin", "framework_of", "import_tensor", "export_tensor", "export_tensors",
           "import_bytes", "import_blobs", "export_bytes"]



@lru_cache(maxsize=None)
def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a format (a FORMATS name).  ml_dtypes supplies the ones NumPy lacks (the
    same types JAX uses); it is imported here, on first need, not by ``import kvzip`` (it takes
    ~0.5 s to load): a float16 / float32 caller, or one that stays in torch, never loads it."""
    dtype_name = FORMATS[name].dtype_name
    if dtype_name in np.sctypeDict:  # float16, float32
        return np.dtype(dtype_name)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, dtype_name))


# Dtypes NumPy and CuPy accept through DLPack; any other dtype crosses as same-width integers.
_DLPACK_NATIVE = frozenset(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 complex64 complex128".split()
)
# Signed where torch's unsigned support is partial; DLPack and .view() only care about width.
_INT_OF_WIDTH = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}
# Dtypes that can hold another format's raw bits (dtype= override); bool and complex cannot.
_RAW_BITS = re.compile(r"u?int(8|16|32|64)|float(16|32|64)|bfloat16|float8_\w+")
_SUPPORTED = ", ".join(f"{f.name} ({f.dtype_name})" for f in FORMATS.values())

_KDL_CUDA = 2  # DLPack device type of CUDA memory


@dataclass(frozen=True)
class Origin:
    """Where an input came from, so results go back to the same framework and device."""

    framework: str                  # "numpy" | "torch" | "cupy" | "jax"
    device: str = "cpu"             # "cpu" | "cuda"
    device_index: int | None = None  # CUDA ordinal; None on the CPU

    @property
    def backend_name(self) -> str:
        return "cuda" if self.device == "cuda" else "cpu"

    # What the GPU runtime (kvzip/gpu, which never imports this module) asks of its caller.
    def results(self, nbytes: int) -> "ResultBuffer":
        """Device memory for nbytes of results, handed out as this caller's arrays."""
        return ResultBuffer(nbytes, self)

    def export_bytes(self, u8):
        """export_bytes(u8, self)."""
        return export_bytes(u8, self)

    def export_tensor(self, bits, fmt: FloatFormat, shape):
        """export_tensor(bits, fmt, shape, self)."""
        return export_tensor(bits, fmt, shape, self)

    def address_of(self, x) -> int | None:
        """cuda_address(x, self)."""
        return cuda_address(x, self)

    def stream_context(self):
        """Run CuPy (and the Numba kernels that follow CuPy's current stream) where the caller works.

        For a CUDA origin the caller's device becomes CuPy's current device; for torch, CuPy's
        current stream also becomes ``torch.cuda.current_stream()``, so kvzip's kernels are
        ordered after the producer's and before the consumer's without a host sync. A CuPy
        caller's current stream already is CuPy's. On the CPU this is a no-op.
        """
        if self.device != "cuda":
            return _NO_SWITCH
        here = self.device_index is None or self.device_index == _cupy().cuda.runtime.getDevice()
        if self.framework != "torch":
            return _NO_SWITCH if here else self._switch()  # nothing to switch: skip building a context
        if here:  # the usual torch call: a (cached) CuPy stream is its own context manager
            return _cupy_stream(_torch_stream_ptr(self.device_index), self.device_index)
        return self._switch()

    def memory_context(self):
        """Take the CuPy allocations of a step-by-step (staged) call from the caller's allocator.

        For a CUDA torch caller, every CuPy allocation inside the context comes from torch's
        caching allocator on the caller's current stream (where the staged kernels run), so a
        result handed to torch is torch's own memory and freed memory goes back to torch: CuPy's
        pool would otherwise keep every block it ever held, out of torch's reach (a receiver
        decoding GiBs of ratio-mode KV into torch's KV cache ran out of memory that way).  Other
        callers keep CuPy's pool; on the CPU this is a no-op."""
        if self.framework != "torch" or self.device != "cuda":
            return _NO_SWITCH
        return _cupy().cuda.using_allocator(partial(_torch_allocation, self.device_index))

    def working_stream(self):
        """The CuPy stream stream_context() makes kvzip's for this CUDA caller, or None where
        that context would first switch to the caller's device (a repeated call's shortcut
        then takes the full path, which switches)."""
        cupy = _cupy()
        if self.device_index is not None and self.device_index != cupy.cuda.runtime.getDevice():
            return None
        if self.framework == "torch":
            return _cupy_stream(_torch_stream_ptr(self.device_index), self.device_index)
        return cupy.cuda.get_current_stream()

    @contextlib.contextmanager
    def _switch(self):
        cupy = _cupy()
        with contextlib.ExitStack() as stack:
            if self.device_index is not None and self.device_index != cupy.cuda.runtime.getDevice():
                stack.enter_context(cupy.cuda.Device(self.device_index))
            if self.framework == "torch":
                stack.enter_context(_cupy_stream(_torch_stream_ptr(self.device_index), self.device_index))
            yield


_NO_SWITCH = contextlib.nullcontext()
_TORCH_NAMES: dict = {}   # torch dtype -> its name without "torch."
_DTYPE_NAMES: dict = {}   # dtype -> its name (numpy's dtype.name is a slow Python property)


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


class _StreamHandle:
    """A raw cudaStream_t behind the CUDA stream protocol, which CuPy 14's Stream.from_external reads."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr  # (protocol version, cudaStream_t)


_STREAMS: dict = {}  # (cudaStream_t, device) -> its CuPy stream object (building one costs ~10 us)


def _cupy_stream(ptr: int, device_index: int | None):
    """CuPy's object for a raw stream.  Cached by address: a wrapper only holds the address, so
    one outliving its stream is harmless, and a new stream at the same address is the same handle."""
    cupy = _cupy()
    if ptr == 0:  # torch's default stream is the legacy null stream
        return cupy.cuda.Stream.null
    stream = _STREAMS.get((ptr, device_index))
    if stream is None:
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14 deprecates ExternalStream
            stream = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        else:
            stream = cupy.cuda.ExternalStream(ptr, device_id=-1 if device_index is None else device_index)
        if len(_STREAMS) >= 256:
            _STREAMS.clear()
        _STREAMS[(ptr, device_index)] = stream
    return stream


def _torch_stream_ptr(device_index: int | None) -> int:
    """The caller's current torch stream on a device, as a raw address.  torch's own accessor
    for it builds a Stream object (~5 us); the raw one, where this torch has it, does not."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(torch.cuda.current_device() if device_index is None else device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def framework_of(x) -> str | None:
    """"numpy", "torch", "cupy" or "jax" for an array of that framework, else None.

    Decided by the defining module's name, so no framework is imported to ask; subclasses
    defined elsewhere are caught by isinstance against frameworks the caller already imported.
    """
    if isinstance(x, (np.ndarray, np.generic)):
        return "numpy"
    root = type(x).__module__.partition(".")[0]
    if root in ("numpy", "torch", "cupy"):
        return root
    if root in ("jax", "jaxlib"):
        return "jax"
    for name, attr in (("torch", "Tensor"), ("cupy", "ndarray"), ("jax", "Array")):
        module = sys.modules.get(name)
        if module is not None and isinstance(x, getattr(module, attr)):
            return name
    return None


# ---------------------------------------------------------------------------------------------
# import


def import_tensor(x, dtype=None) -> tuple[object, FloatFormat, tuple[int, ...], Origin]:
    """``(bits, fmt, shape, origin)`` for a float tensor of any supported framework.

    ``bits`` is 1-D, C-contiguous, of ``fmt.uint_dtype``, a NumPy array on the CPU or a CuPy
    array on CUDA, and a view of ``x``'s memory unless ``x`` is non-contiguous (then a contiguous
    copy in C order). ``dtype`` names the format when ``x`` holds raw bits (a uint16 array of bf16
    values, say); ``x``'s element width must then match the format's.
    """
    override = None if dtype is None else _format_of(dtype)
    arr, name, origin = _borrow(x)
    fmt = _resolve_format(name, arr.dtype.itemsize, override, origin.framework)
    return _bits_of(arr, fmt, origin), fmt, arr.shape, origin  # NumPy's and CuPy's shapes are tuples of ints


def _bits_of(arr, fmt: FloatFormat, origin: Origin):
    """arr (NumPy or CuPy, of fmt's width) as the 1-D C-contiguous uint array the codec takes."""
    bits = _contiguous_bits(arr, fmt, origin) if _c_contiguous(arr) else None
    if bits is not None:
        return bits
    with origin.stream_context():  # a non-contiguous input is copied on the caller's stream
        return arr.ravel().view(fmt.uint_dtype)


def _contiguous_bits(arr, fmt: FloatFormat, origin: Origin):
    """_bits_of for a C-contiguous arr without a copy, or None where that takes ravel/view."""
    if arr.ndim == 1 and arr.dtype == fmt.uint_dtype:
        return arr  # already what the codec works on
    if origin.device == "cuda" and arr.size:  # one constructor: ravel() and view() cost ~1.3 us each
        return _cupy().ndarray((arr.size,), fmt.uint_dtype, arr.data)
    return None


def cuda_address(x, origin: Origin) -> int | None:
    """x's device address when x is a contiguous CUDA array of origin's framework (a CuPy array
    or a torch tensor, not a subclass) on origin's device: what import_tensor views in place for
    such a caller; else None."""
    if origin.framework == "cupy":
        if type(x) is not cupy_ndarray() or not _c_contiguous(x):
            return None
        data = x.data
        return data.ptr if data.device_id == origin.device_index else None
    if origin.framework == "torch" and origin.device == "cuda":
        import torch

        if type(x) is not torch.Tensor or x.get_device() != origin.device_index or x.layout is not torch.strided \
                or not x.is_contiguous() or x.is_neg():
            return None
        return x.data_ptr()
    return None


# cuda_addresses' reads, one C-level map over a batch each.
_TYPE_OF, _DTYPE, _SHAPE, _DATA = type, attrgetter("dtype"), attrgetter("shape"), attrgetter("data")
_PTR, _DEVICE_ID, _CUPY_CONTIGUOUS = attrgetter("ptr"), attrgetter("device_id"), attrgetter("_c_contiguous")
_GET_DEVICE, _LAYOUT, _DATA_PTR = methodcaller("get_device"), attrgetter("layout"), methodcaller("data_ptr")
_IS_CONTIGUOUS, _IS_NEG = methodcaller("is_contiguous"), methodcaller("is_neg")
_MISALIGNED = (16).__rmod__  # p -> p % 16


def cuda_addresses(xs) -> tuple | None:
    """(origin, device addresses) when every x in xs is what cuda_address views in place, and all
    alike: CuPy arrays or torch CUDA tensors (not subclasses) of one device, dtype and shape,
    contiguous, each starting on a 16-byte boundary; else None.  cuda_address's checks for a
    batch, made a property at a time over the whole list by C-level maps, where a Python loop
    calling cuda_address costs a batch encode's host ~0.6 us a tensor ahead of its launch."""
    if not xs:
        return None
    x0, k = xs[0], len(xs)
    kind = type(x0)
    if kind is not cupy_ndarray() and kind is not torch_tensor():
        return None
    if list(map(_TYPE_OF, xs)).count(kind) != k or list(map(_DTYPE, xs)).count(x0.dtype) != k \
            or list(map(_SHAPE, xs)).count(x0.shape) != k:
        return None
    if kind is cupy_ndarray():
        data = list(map(_DATA, xs))
        device = data[0].device_id
        if not all(map(_CUPY_CONTIGUOUS, xs)) or list(map(_DEVICE_ID, data)).count(device) != k:
            return None
        ptrs, framework = list(map(_PTR, data)), "cupy"
    else:
        import torch

        device = x0.get_device()  # -1 on the CPU
        if device < 0 or list(map(_GET_DEVICE, xs)).count(device) != k \
                or list(map(_LAYOUT, xs)).count(torch.strided) != k or not all(map(_IS_CONTIGUOUS, xs)) \
                or any(map(_IS_NEG, xs)):
            return None
        ptrs, framework = list(map(_DATA_PTR, xs)), "torch"
    if any(map(_MISALIGNED, ptrs)):
        return None
    return _cuda_origin(framework, device), ptrs


def blob_addresses(blobs) -> tuple | None:
    """(origin, device addresses, lengths) when every blob is a contiguous 1-D uint8 CUDA array of
    one framework (CuPy, or torch) and one device, starting on a 16-byte boundary (a batch
    compress_many gave back), else None: what import_blobs and the fast path's alignment check
    would find, in one pass that reads no more of each blob than that."""
    if not blobs:
        return None
    kind = type(blobs[0])
    if kind is cupy_ndarray():
        return _cupy_blob_addresses(blobs, kind)
    if kind is torch_tensor():
        return _torch_blob_addresses(blobs, kind)
    return None


def _cupy_blob_addresses(blobs, nd) -> tuple | None:
    device = blobs[0].data.device_id
    ptrs, lengths = [], []
    for b in blobs:
        if type(b) is not nd or b.dtype is not _U8 or b.ndim != 1 or not b._c_contiguous:
            return None
        data = b.data
        ptr = data.ptr
        if ptr % 16 or data.device_id != device:
            return None
        ptrs.append(ptr)
        lengths.append(b.size)
    return _cuda_origin("cupy", device), ptrs, lengths


def _torch_blob_addresses(blobs, tensor) -> tuple | None:
    """_cupy_blob_addresses for torch CUDA tensors: a handful of attribute reads a blob, where
    import_bytes builds a CuPy array over each (~5 us a blob: benchmarks/NOTES.md, v19)."""
    import torch

    device = blobs[0].get_device()  # -1 on the CPU
    if device < 0:
        return None
    u8 = torch.uint8
    ptrs, lengths = [], []
    for b in blobs:
        if type(b) is not tensor or b.dtype is not u8 or b.dim() != 1 or b.get_device() != device \
                or b.layout is not torch.strided or not b.is_contiguous():
            return None
        ptr = b.data_ptr()
        if ptr % 16:
            return None
        ptrs.append(ptr)
        lengths.append(b.numel())
    return _cuda_origin("torch", device), ptrs, lengths


def aligned(a) -> bool:
    """Whether a CuPy array starts on a 16-byte boundary (the fast kernels' vector loads need it)."""
    return a.data.ptr % 16 == 0


def _c_contiguous(a) -> bool:
    """a.flags.c_contiguous, from CuPy's own flag where a has it (CuPy's a.flags builds an
    object: ~0.5 us)."""
    flag = getattr(a, "_c_contiguous", None)
    return a.flags.c_contiguous if flag is None else flag


def import_bytes(blob) -> tuple[object, Origin]:
    """``(u8, origin)``: a blob as a 1-D contiguous uint8 NumPy (CPU) or CuPy (CUDA) array.

    Python buffers (bytes, bytearray, memoryview, ...) are read in place as NumPy; arrays of any
    supported framework must be 1-D uint8 and are viewed in place when contiguous.
    """
    framework = framework_of(blob)
    if framework is None and not _has_array_protocol(blob):
        try:
            view = memoryview(blob)
        except TypeError:
            raise TypeError(f"expected a blob (bytes or a 1-D uint8 array), got {type(blob).__name__}") from None
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        return np.frombuffer(view.cast("B"), dtype=np.uint8), Origin("numpy")
    arr, name, origin = _borrow(blob, framework)
    if name != "uint8" or arr.ndim != 1:
        raise TypeError(
            f"a kvzip blob must be a 1-D uint8 array; got a {origin.framework} array "
            f"of dtype {name} with shape {tuple(arr.shape)}"
        )
    if _c_contiguous(arr):
        return arr, origin
    with origin.stream_context():
        return arr.ravel(), origin


def import_blobs(blobs) -> list[tuple]:
    """:func:`import_bytes` for each of blobs; contiguous 1-D uint8 CuPy arrays on one device (a
    batch :func:`kvzip.compress_many` gave back) take a check each and share one origin."""
    out = []
    nd = cupy_ndarray()
    origin = None  # of the last CuPy blob
    for b in blobs:
        if origin is not None and type(b) is nd and b.dtype is _U8 and b.ndim == 1 \
                and b.data.device_id == origin.device_index and _c_contiguous(b):
            out.append((b, origin))
            continue
        got = import_bytes(b)
        out.append(got)
        origin = got[1] if type(b) is nd else None
    return out


_U8 = np.dtype(np.uint8)


def _borrow(x, framework: str | None = None) -> tuple[object, str, Origin]:
    """``x`` as a NumPy/CuPy array of the same shape and element width (a view where DLPack
    allows), the name of ``x``'s own dtype, and its origin.  framework: framework_of(x) when the
    caller already asked."""
    framework = framework or framework_of(x)
    if framework == "numpy":
        arr = _native(x if isinstance(x, np.ma.MaskedArray) else np.asarray(x))
        return arr, arr.dtype.name, Origin("numpy")
    if framework == "torch":
        return _borrow_torch(x)
    if framework == "cupy":
        return x, _dtype_name(x.dtype), _cuda_origin("cupy", x.data.device_id)
    if framework == "jax":
        return _borrow_jax(x)
    return _borrow_foreign(x)


def _native(arr: np.ndarray) -> np.ndarray:
    """arr with its values in the machine's byte order: the codec reads the values' bits from
    memory, so a big-endian array is copied into native order (the same values, so a '>u2' of
    raw bits keeps its bits too).  A masked array is refused: its mask would be lost."""
    if isinstance(arr, np.ma.MaskedArray):
        raise TypeError("kvzip cannot compress a masked array (its mask would be lost); "
                        "pass arr.filled(value) or arr.data with the mask separately")
    if arr.dtype.isnative:
        return arr
    if arr.dtype.fields is not None or arr.dtype.subdtype is not None:
        return arr  # structured or sub-array dtypes: refused by name later (no format has them)
    return arr.astype(arr.dtype.newbyteorder("="))


@lru_cache(maxsize=None)
def _cuda_origin(framework: str, device: int) -> Origin:
    """One Origin per framework and CUDA device (the batch paths group results by its identity)."""
    return Origin(framework, "cuda", device)


def _borrow_torch(t):
    import torch

    name = _TORCH_NAMES.get(t.dtype)
    if name is None:
        name = _TORCH_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
    if t.is_nested:
        raise TypeError("kvzip takes dense torch tensors, not nested ones; compress each component tensor "
                        "(t.unbind()) or a padded copy (t.to_padded_tensor(0))")
    if t.is_cuda and t.layout is torch.strided and t.is_contiguous() and t.numel() and not t.is_neg():
        # Contiguous CUDA memory becomes a CuPy array over the tensor's own memory (the tensor
        # owns it): far cheaper than the DLPack capsule and its stream handshake.
        width = np.dtype(name) if name in _DLPACK_NATIVE else _INT_OF_WIDTH.get(t.element_size())
        if width is None:
            raise _unsupported(name, "torch")
        index = t.get_device()
        return _cupy_over_torch(t, tuple(t.shape), width, index), name, _cuda_origin("torch", index)
    t = resolve_lazy_bits(t.detach())  # DLPack refuses tensors that require grad; same bits
    if t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"kvzip takes dense CPU or CUDA torch tensors, got {t.layout} on {t.device}")
    if name not in _DLPACK_NATIVE:
        # bf16/fp8: same-width integers cross DLPack; a same-width .view() never copies,
        # whatever the strides.
        try:
            t = t.view(_torch_dtype(_INT_OF_WIDTH[t.element_size()].name))
        except (KeyError, RuntimeError):
            raise _unsupported(name, "torch") from None
    if t.device.type == "cpu":
        return np.from_dlpack(t), name, Origin("torch")
    origin = _cuda_origin("torch", t.device.index)
    with origin.stream_context():  # consumer stream = producer stream: DLPack needs no event
        return _cupy().from_dlpack(t), name, origin


def resolve_lazy_bits(t):
    """A torch tensor whose memory holds its own values: one with torch's lazy negative or
    conjugate bit set has memory holding the values before negation / conjugation, so those are
    resolved (a copy); any other tensor is returned as it is."""
    if t.is_neg():
        t = _resolve_neg(t)
    if t.is_conj():
        t = t.resolve_conj()
    return t


def _resolve_neg(t):
    """t.resolve_neg(), also for the float dtypes torch cannot negate (float8): negating an IEEE
    float flips its sign bit and nothing else, NaNs included."""
    import torch

    try:
        return t.resolve_neg()
    except (NotImplementedError, RuntimeError):
        if not t.is_floating_point() or not hasattr(torch, "_neg_view"):
            raise TypeError(f"kvzip cannot read a torch tensor of dtype {t.dtype} with the negative bit set; "
                            "pass t.resolve_neg() or a copy") from None
    int_dtype = _torch_dtype(_INT_OF_WIDTH[t.element_size()].name)
    stored = torch._neg_view(t).view(int_dtype)  # the memory as it is, before the lazy negation
    sign = np.array(1 << (8 * t.element_size() - 1), np.uint64).astype(_INT_OF_WIDTH[t.element_size()]).item()
    return torch.bitwise_xor(stored, sign).view(t.dtype)


def _borrow_jax(x):
    if len(x.devices()) != 1:
        raise TypeError("kvzip compresses one device's buffer; gather the sharded jax array first")
    name = np.dtype(x.dtype).name
    device_type, device_id = x.__dlpack_device__()
    if int(device_type) != _KDL_CUDA:
        return np.asarray(x), name, Origin("jax")  # jax's own buffer, read-only, no copy
    if not _cupy_holds(np.dtype(x.dtype)):
        import jax

        try:  # a copy in XLA: JAX has no in-place reinterpretation
            x = jax.lax.bitcast_convert_type(x, _INT_OF_WIDTH[x.dtype.itemsize])
        except (KeyError, TypeError, ValueError):
            raise _unsupported(name, "jax") from None
    return _cupy().from_dlpack(x), name, _cuda_origin("jax", int(device_id))


def _borrow_foreign(x):
    """Objects of other libraries: CUDA memory through CuPy, everything else through NumPy."""
    on_cuda = hasattr(x, "__cuda_array_interface__") or (
        hasattr(x, "__dlpack_device__") and int(x.__dlpack_device__()[0]) == _KDL_CUDA
    )
    if on_cuda:
        cupy = _cupy()
        arr = cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x)
        return arr, arr.dtype.name, _cuda_origin("cupy", int(arr.device.id))
    if hasattr(x, "__array_interface__") or hasattr(x, "__array_struct__"):
        arr = _native(np.asarray(x))
    elif hasattr(x, "__dlpack__"):
        arr = np.from_dlpack(x)
    else:
        raise TypeError(
            f"expected a NumPy, PyTorch, CuPy or JAX array, or an object exposing __dlpack__ or "
            f"__array_interface__; got {type(x).__name__}{_cache_hint(x)}"
        )
    return arr, arr.dtype.name, Origin("numpy")


def _cache_hint(x) -> str:
    """A pointer to kvzip.hf for a transformers Cache (or a subclass defined elsewhere), which
    holds many tensors; found by module name so transformers is never imported to ask."""
    if any(c.__module__.startswith("transformers.") and c.__name__.endswith("Cache") for c in type(x).__mro__):
        return "; a transformers cache holds one K and V tensor per layer: use kvzip.hf.compress_cache(cache)"
    return ""


def _has_array_protocol(x) -> bool:
    return any(hasattr(x, a) for a in ("__array_interface__", "__array_struct__", "__dlpack__",
                                         "__cuda_array_interface__"))


def format_of_dtype(dtype) -> FloatFormat:
    """The format a dtype names (a format name, or a NumPy/ml_dtypes/JAX/torch dtype)."""
    return _format_of(dtype)


def borrow_writable(x, what: str) -> tuple[object, str, Origin]:
    """``(arr, dtype name, origin)``: x as a NumPy or CuPy array over x's own memory, which the
    caller will write (compress_into's destination): a TypeError names `what` where that needs
    a copy (not contiguous, read-only, a lazily negated torch tensor) or x is no array."""
    if framework_of(x) is None and not _has_array_protocol(x):
        raise TypeError(f"{what} must be an array (NumPy, CuPy, torch), got {type(x).__name__}")
    if framework_of(x) == "torch" and (x.is_neg() or x.is_conj() or not x.is_contiguous()):
        raise TypeError(f"{what} must be a contiguous torch tensor without a lazy negative or conjugate bit")
    arr, name, origin = _borrow(x)
    if not _c_contiguous(arr) or (isinstance(arr, np.ndarray) and not arr.flags.writeable):
        raise TypeError(f"{what} must be contiguous and writable: the call writes into its memory")
    return arr, name, origin


def _format_of(dtype) -> FloatFormat:
    """The format a ``dtype=`` argument names: a format name, or a NumPy/ml_dtypes/JAX/torch dtype."""
    if isinstance(dtype, (FloatFormat, str)):
        return get_format(dtype)
    try:
        name = np.dtype(dtype).name  # np.float16, ml_dtypes.bfloat16, jnp.bfloat16, np.dtype(...)
    except TypeError:
        name = dtype  # a torch dtype: get_format reads "torch.bfloat16"
    return get_format(name)


@lru_cache(maxsize=256)  # successful answers only (errors raise): a serving loop asks the same few
def _resolve_format(name: str, itemsize: int, override: FloatFormat | None, framework: str) -> FloatFormat:
    if override is None:
        fmt = BY_DTYPE_NAME.get(name)
        if fmt is None:
            raise _unsupported(name, framework)
        return fmt
    if not _RAW_BITS.fullmatch(name):
        raise TypeError(f"dtype={override.name!r} reinterprets raw bits, which a {framework} array of dtype "
                        f"{name} cannot hold; pass an integer array of the format's width")
    if itemsize != override.itemsize:
        raise TypeError(f"dtype={override.name!r} needs {override.itemsize}-byte elements, but the "
                        f"{framework} array's dtype {name} has {itemsize}-byte elements")
    return override


def _unsupported(name: str, framework: str) -> TypeError:
    hint = "; an integer array holding raw float bits needs dtype=<format>" if _RAW_BITS.fullmatch(name) else ""
    return TypeError(f"kvzip cannot compress a {framework} array of dtype {name}: "
                     f"supported formats are {_SUPPORTED}{hint}")


# ---------------------------------------------------------------------------------------------
# export


def export_tensor(bits, fmt: FloatFormat, shape, origin: Origin):
    """The inverse of :func:`import_tensor`: ``bits`` (1-D, ``fmt.uint_dtype``, NumPy or CuPy) as
    a tensor of ``origin``'s framework and device, of ``fmt``'s dtype and ``shape``.

    A view of ``bits`` wherever the target framework allows; the exceptions are JAX arrays of
    float8 (and of bf16 before CuPy 14) on CUDA, one XLA copy, and results that must change
    device. CuPy results in a dtype CuPy lacks (float8; bf16 before CuPy 14) stay unsigned bits.
    """
    fmt = get_format(fmt)
    shape = tuple(shape)
    if origin.framework == "torch":  # first: torch needs no NumPy dtype (nor ml_dtypes)
        ints = bits.view(_INT_OF_WIDTH[fmt.itemsize])  # integers cross DLPack; torch reinterprets
        return _to_torch(ints, origin).view(_torch_dtype(fmt.dtype_name)).reshape(shape)
    if origin.framework == "cupy" and not isinstance(bits, np.ndarray):
        # one constructor call: a view and a reshape cost ~8 us more
        return _cupy().ndarray(shape, _cupy_dtype(fmt), bits.data)
    np_dtype = numpy_dtype(fmt.name)
    if origin.framework == "numpy":
        return _to_numpy(bits).view(np_dtype).reshape(shape)
    if origin.framework == "cupy":
        out = _to_cupy(bits, origin)
        return (out.view(np_dtype) if _cupy_holds(np_dtype) else out).reshape(shape)
    if origin.framework == "jax":
        if origin.device == "cpu":
            return _to_jax(_to_numpy(bits).view(np_dtype).reshape(shape), origin)
        out = _to_cupy(bits, origin).reshape(shape)
        if _cupy_holds(np_dtype):  # then DLPack carries it too: no copy
            return _to_jax(out.view(np_dtype), origin)
        import jax

        return jax.lax.bitcast_convert_type(_to_jax(out, origin), np_dtype)
    raise ValueError(f"unknown framework {origin.framework!r}")


class ResultBuffer(DeviceBuffer):
    """Device memory for a call's results in a caller's framework (Origin.results): .ptr its
    address for the kernels, .array a CuPy uint8 array over it.

    For a CUDA torch caller the memory comes from torch's allocator, on the caller's current
    stream (where kvzip's work runs), and results are slices of that tensor: narrow() and view()
    cost a fraction of a DLPack export of a CuPy array.  Other callers get memory from CuPy's
    pool, and the results are the only CuPy arrays built over it (benchmarks/NOTES.md, v18)."""

    __slots__ = ("tensor", "origin")

    def __init__(self, nbytes: int, origin: Origin | None = None):
        self.origin, self.tensor = origin, None
        if origin is not None and origin.framework == "torch" and origin.device == "cuda":
            import torch

            self._array, self.nbytes, self.memory = None, max(nbytes, 1), None
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=torch.device("cuda", origin.device_index))
            self.ptr = self.tensor.data_ptr()  # all the kernels need: the CuPy view is built only if asked for
        else:
            super().__init__(nbytes)

    @property
    def array(self):
        """The buffer as a CuPy uint8 array (for a torch buffer, a view of its tensor)."""
        if self._array is None and self.tensor is not None:
            self._array = _cupy_over_torch(self.tensor, (self.nbytes,), _U8, self.origin.device_index)
        return super().array

    def places(self, starts) -> list:
        """DeviceBuffer.places (None for a torch buffer: nothing to work out)."""
        return None if self.tensor is not None else super().places(starts)

    def blobs(self, starts, lengths, places=None) -> list:
        """DeviceBuffer.blobs as 1-D uint8 arrays of the caller's framework (CuPy without an
        origin)."""
        if self.tensor is not None:
            t = self.tensor
            return [None if n is None else t.narrow(0, s, n) for s, n in zip(starts, lengths)]
        out = super().blobs(starts, lengths, places)
        if self.origin is None or self.origin.framework == "cupy":
            return out
        return [None if b is None else export_bytes(b, self.origin) for b in out]

    def tensors(self, pieces) -> list:
        """:func:`export_tensors` of this buffer's pieces [(byte offset, fmt, shape)] for its origin."""
        if self.tensor is None:
            return _export_pieces(self.memory, pieces, self.origin)
        # One as_strided a piece over the buffer viewed once per dtype, where narrow, view and view
        # cost three torch calls a piece.
        t, typed, strides, out = self.tensor, {}, {}, []
        for at, fmt, shape in pieces:
            whole = typed.get(fmt.name)
            if whole is None:
                whole = typed[fmt.name] = t.narrow(0, 0, self.nbytes - self.nbytes % fmt.itemsize).view(
                    _torch_dtype(fmt.dtype_name))
            if at % fmt.itemsize:  # not on an element boundary of the typed view (the decoders align them)
                out.append(t.narrow(0, at, math.prod(shape) * fmt.itemsize).view(whole.dtype).view(shape))
                continue
            st = strides.get(shape)
            if st is None:
                st = strides[shape] = _c_strides(shape)
            out.append(whole.as_strided(shape, st, at // fmt.itemsize))
        return out


def _c_strides(shape: tuple) -> tuple:
    """Element strides of a C-contiguous array of shape."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def export_tensors(buffer, pieces, origin: Origin) -> list:
    """:func:`export_tensor` for pieces of one CuPy buffer: pieces is [(byte offset, fmt, shape)].
    For a CuPy caller each result is built straight on the buffer (one constructor, ~1.5 us);
    other frameworks get export_tensor of each piece's raw bits."""
    return _export_pieces(buffer.data, pieces, origin)


def _export_pieces(at, pieces, origin: Origin) -> list:
    """export_tensors of the memory at (a cupy.cuda.MemoryPointer)."""
    cupy = _cupy()
    if origin.framework == "cupy":
        return [cupy.ndarray(shape, _cupy_dtype(fmt), at + offset if offset else at) for offset, fmt, shape in pieces]
    return [export_tensor(cupy.ndarray((math.prod(shape),), fmt.uint_dtype, at + offset), fmt, shape, origin)
            for offset, fmt, shape in pieces]


def _cupy_dtype(fmt: FloatFormat) -> np.dtype:
    """What a CuPy result of fmt holds: fmt's dtype where CuPy has it, else its raw bits."""
    dtype = numpy_dtype(fmt.name)
    return dtype if _cupy_holds(dtype) else fmt.uint_dtype


def export_bytes(u8, origin: Origin):
    """A 1-D uint8 array (NumPy or CuPy) as a 1-D uint8 array of ``origin``'s framework and device."""
    if origin.framework == "numpy":
        return _to_numpy(u8)
    if origin.framework == "cupy":
        return _to_cupy(u8, origin)
    if origin.framework == "torch":
        return _to_torch(u8, origin)
    if origin.framework == "jax":
        return _to_jax(_to_numpy(u8) if origin.device == "cpu" else _to_cupy(u8, origin), origin)
    raise ValueError(f"unknown framework {origin.framework!r}")


def _to_numpy(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else _cupy().asnumpy(a)


def _to_cupy(a, origin: Origin):
    if not isinstance(a, np.ndarray):
        return a
    with origin.stream_context():
        return _cupy().asarray(a)


def _to_torch(a, origin: Origin):
    import torch

    if isinstance(a, np.ndarray) and not a.flags.writeable:
        # torch tensors are always writable: never hand out a writable alias of read-only memory
        # (a view into the caller's bytes object, say)
        a = a.copy()
    with origin.stream_context():
        t = torch.from_dlpack(a)
    target = torch.device("cuda", origin.device_index) if origin.device == "cuda" else torch.device("cpu")
    return t if t.device == target else t.to(target)


def _to_jax(a, origin: Origin):
    """NumPy -> JAX on the CPU (``device_put`` aliases an aligned buffer, else copies; JAX treats
    the result as immutable); CuPy -> JAX on CUDA through DLPack, no copy."""
    import jax

    if isinstance(a, np.ndarray):
        return jax.device_put(a, jax.devices("cpu")[0])
    return jax.dlpack.from_dlpack(a)


@lru_cache(maxsize=None)
def _cupy_holds(dtype: np.dtype) -> bool:
    """Whether this CuPy has arrays of ``dtype``: the plain dtypes always, bfloat16 from CuPy 14
    (which also moves it through DLPack), float8 in no release yet. Asked of CuPy, since
    dtype.kind cannot tell: ml_dtypes gives float8_e5m2 kind "f" and bfloat16 kind "V"."""
    if dtype.name in _DLPACK_NATIVE:
        return True
    try:
        _cupy().empty(0, dtype=dtype)
    except (TypeError, ValueError):  # CuPy 14 says ValueError("Unsupported dtype float8_e5m2")
        return False
    return True


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _torch_allocation(device_index: int, nbytes: int):
    """A CuPy allocator's answer (a MemoryPointer) for nbytes of torch memory on device_index,
    the tensor kept alive by the memory."""
    import torch

    return _torch_memory(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=torch.device("cuda", device_index)),
                         device_index)


def _torch_memory(t, device_index: int):
    """A CuPy MemoryPointer over a contiguous CUDA torch tensor's own memory (t, its owner, kept
    alive by it)."""
    cupy = _cupy()
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t, device_index)
    return cupy.cuda.MemoryPointer(memory, 0)


def _cupy_over_torch(t, shape: tuple, dtype, device_index: int):
    """A CuPy array of shape and dtype over a contiguous CUDA torch tensor's own memory (t, its
    owner, kept alive by the array)."""
    return _cupy().ndarray(shape, dtype, _torch_memory(t, device_index))


def cupy_ndarray():
    """CuPy's ndarray class, or a class nothing is an instance of when CuPy is not imported (an
    array of it cannot exist then)."""
    cupy = sys.modules.get("cupy")
    return cupy.ndarray if cupy is not None else _Never


def torch_tensor():
    """torch.Tensor, or a class nothing is an instance of when torch is not imported."""
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else _Never


class _Never:
    pass


def _cupy():
    """The cupy module, imported on first use and then held: an import statement in each of a
    call's several asks cost ~0.2 us apiece (benchmarks/NOTES.md, v22)."""
    global _cupy_module
    if _cupy_module is None:
        try:
            import cupy
        except ImportError as e:
            raise ImportError("CUDA arrays need CuPy: pip install 'kvzip[gpu]'") from e
        _cupy_module = cupy
    return _cupy_module


_cupy_module = None
