"""ZipLinear: an nn.Linear whose BF16 weight lives in the tiled layout, multiplied by the fused
decode+GEMM on the GPU; compress_model replaces every eligible nn.Linear of a model.

Routing of a forward on CUDA, by N (the rows of x, all leading dimensions flattened):
N <= route_n (32) takes the custom op tiled_linear, whose kvz_w_gemm reads the compressed weight
once and never writes W; wider x decodes W into a temporary and calls cuBLAS (torch's matmul).
tiled_linear itself also takes wider x, through kvz_w_gemm_wide (x staged in shared memory and
shared by a block's eight bands); ZipLinear routes to it once a GPU has measured it against
decode + cuBLAS (benchmarks/NOTES.md w8: host-tested only so far).  On the CPU the reference
decoder runs and torch multiplies: correct, not fast.

The fused paths sum in FP32 like cuBLAS, in their own order (tensor-core tiles, warps, K splits
in a fixed order, then the escapes and the bias), so outputs agree with nn.Linear's within BF16
rounding, not bit for bit; the weight itself is always exact (decompress_weight).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..gpu import weights as gpu
from . import tiled
from .tiled import TiledWeight

_ARRAYS = ("blocks", "codebook", "esc_off", "esc_pos", "esc_val")


@torch.library.custom_op("kvzip::tiled_linear", mutates_args=("tickets",))
def tiled_linear(x: torch.Tensor, blocks: torch.Tensor, codebook: torch.Tensor, esc_off: torch.Tensor,
                 esc_pos: torch.Tensor, esc_val: torch.Tensor, bias: torch.Tensor | None, tickets: torch.Tensor,
                 m: int, k: int) -> torch.Tensor:
    """y = x W^T + bias by kvz_w_gemm (N <= 32) or kvz_w_gemm_wide: x (N x K) contiguous BF16 on
    W's GPU, K % 16 == 0.  tickets: the module's split counters, one a band (int32, zero before
    and after)."""
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16 or x.device.type != "cuda" or k % 16:
        raise ValueError(f"tiled_linear takes x of shape (N, {k}) in bfloat16 on a GPU with K % 16 == 0, "
                         f"got {tuple(x.shape)} {x.dtype} on {x.device}")
    if x.data_ptr() % 16 or not x.is_contiguous():  # the kernels read rows of x 16 bytes at a time
        x = x.clone(memory_format=torch.contiguous_format)
    tw = TiledWeight((m, k), blocks, codebook, esc_off, esc_pos, esc_val)
    return fused_product(tw, x, bias, tickets, wide=x.shape[0] > gpu.MAX_N)


def fused_product(tw: TiledWeight, x: torch.Tensor, bias: torch.Tensor | None, tickets: torch.Tensor,
                  wide: bool) -> torch.Tensor:
    """x W^T + bias by kvz_w_gemm (wide False: N <= 32) or kvz_w_gemm_wide (any N), on x's
    device's current stream; x as tiled_linear has checked it.  (tiled_linear picks by N; a
    benchmark may ask for the wide kernel where ZipLinear does not take it.)"""
    (m, k), n = tw.shape, x.shape[0]
    y = torch.empty((n, m), dtype=torch.bfloat16, device=x.device)
    if wide:
        plan = gpu.wide_plan((m, k), n, x.device.index)
        floats = gpu.wide_partial_floats((m, k), n, plan[0])
        launch = gpu.gemm_wide
    else:
        plan = gpu.gemm_plan((m, k), n, x.device.index)
        floats = plan[0] * tiled.grid((m, k))[0] * 16 * n if plan[0] > 1 else 0
        launch = gpu.gemm
    partial = _partials(x, floats) if floats else tickets  # without splits the kernels never read it
    launch(tw, x, bias, y, partial, tickets, plan, tiled.cuda_stream(x.device.index))
    return y


@tiled_linear.register_fake
def _(x, blocks, codebook, esc_off, esc_pos, esc_val, bias, tickets, m, k):
    return x.new_empty((x.shape[0], m))


def _partials(x: torch.Tensor, floats: int) -> torch.Tensor:
    """Scratch for the split sums, from torch's caching allocator on x's stream (reused, graph
    capturable; its contents never outlive the kernel)."""
    return torch.empty(floats, dtype=torch.float32, device=x.device)


class ZipLinear(nn.Module):
    """``y = x W^T + b`` with W (out_features x in_features, BF16) held compressed.

    Buffers (all in state_dict): blocks, codebook, esc_off, esc_pos, esc_val (the tiled
    layout), shape, and bias (or None).  Inputs: BF16 of shape (..., in_features) on the
    module's device.
    """

    route_n = gpu.MAX_N  # widest x ZipLinear multiplies fused (32); wider decodes W for cuBLAS

    def __init__(self, tw: TiledWeight, bias: torch.Tensor | None = None):
        super().__init__()
        tw.validate()
        self.out_features, self.in_features = tw.shape
        for name, a in zip(_ARRAYS, tw.arrays()):
            self.register_buffer(name, a)
        self.register_buffer("shape", torch.tensor(tw.shape, dtype=torch.int64))
        if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (self.out_features,)):
            raise ValueError(f"bias must be bfloat16 of shape ({self.out_features},), got {bias.dtype} {tuple(bias.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self.register_buffer("tickets", torch.zeros(tiled.grid(tw.shape)[0], dtype=torch.int32, device=tw.device),
                             persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "ZipLinear":
        """The Linear's weight and bias, compressed on the weight's device."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"ZipLinear.from_linear takes an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if w.dtype != torch.bfloat16:
            raise ValueError(f"ZipLinear holds BF16 weights; this Linear's are {w.dtype} (cast it with "
                             f".to(torch.bfloat16) first, or keep it: kvzip.compress handles FP16 and FP32 losslessly)")
        if linear.bias is not None and linear.bias.dtype != torch.bfloat16:
            raise ValueError(f"the bias is {linear.bias.dtype}; ZipLinear's bias is BF16 like its weight")
        return cls(tiled.encode(w), None if linear.bias is None else linear.bias.detach())

    # ------------------------------------------------------------------ the layout
    @property
    def tiled(self) -> TiledWeight:
        return TiledWeight((self.out_features, self.in_features), *(getattr(self, n) for n in _ARRAYS))

    @property
    def ratio(self) -> float:
        """Bytes of the BF16 weight over the bytes of its tiled layout."""
        return self.tiled.ratio

    def decompress_weight(self) -> torch.Tensor:
        """W, bit for bit, on the module's device."""
        tw = self.tiled
        if tw.device.type != "cuda":
            return tiled.decode(tw)
        out = torch.empty(tw.shape, dtype=torch.bfloat16, device=tw.device)
        gpu.decode(tw, out, tiled.cuda_stream(tw.device.index))
        return out

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            raise TypeError(f"ZipLinear takes bfloat16 input, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.device != self.blocks.device:
            raise ValueError(f"input on {x.device}, ZipLinear on {self.blocks.device}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"input of shape {tuple(x.shape)}: the last dimension must be in_features = {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        n = x2.shape[0]
        if x.device.type == "cuda" and 0 < n <= self.route_n and self.in_features % 16 == 0:
            y = tiled_linear(x2.contiguous(), self.blocks, self.codebook, self.esc_off, self.esc_pos, self.esc_val,
                             self.bias, self.tickets, self.out_features, self.in_features)
        else:
            y = F.linear(x2, self.decompress_weight(), self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"ratio={self.ratio:.4f}")

    # ------------------------------------------------------------------ state_dict
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """The layout's arrays are taken as they come (their lengths follow the weight's
        escapes, so they need not match this module's), and validated first."""
        keys = [prefix + n for n in (*_ARRAYS, "shape")]
        if all(k in state_dict for k in keys):
            shape = tuple(int(v) for v in state_dict[prefix + "shape"].tolist())
            device = self.blocks.device
            tw = TiledWeight(shape, *(state_dict[prefix + n].to(device) for n in _ARRAYS)).validate()
            self.out_features, self.in_features = shape
            for name, a in zip(_ARRAYS, tw.arrays()):
                setattr(self, name, a)
            self.shape = torch.tensor(shape, dtype=torch.int64, device=device)
            self.tickets = torch.zeros(tiled.grid(shape)[0], dtype=torch.int32, device=device)
            bias = state_dict.get(prefix + "bias")
            self.bias = None if bias is None else bias.to(device=device, dtype=torch.bfloat16)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _shared_weights(model: nn.Module) -> set:
    """ids of weights more than one module holds (tied embeddings): compressing one copy would
    keep both."""
    seen, shared = set(), set()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor):
            (shared if id(w) in seen else seen).add(id(w))
    return shared


def compress_model(model: nn.Module, *, progress: bool | None = None) -> nn.Module:
    """Every nn.Linear of ``model`` with a 2-D BF16 weight replaced by a ZipLinear, in place,
    where the tiled layout is smaller than the weight and the weight is not tied to another
    module; returns the model.  progress: a bar on stderr (default: when stderr is a terminal)."""
    from tqdm import tqdm

    shared = _shared_weights(model)
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16 and id(m.weight) not in shared]
    bar = tqdm(targets, desc="compress_model", unit="linear", file=sys.stderr,
               disable=not (sys.stderr.isatty() if progress is None else progress))
    for name, linear in bar:
        zl = ZipLinear.from_linear(linear)
        if zl.ratio <= 1.0:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, zl)
    return model

