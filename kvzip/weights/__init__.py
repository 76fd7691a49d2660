"""Lossless BF16 model weights (the ZipServ half of kvzip): the tiled layout and its fused
decode+GEMM (ZipLinear, compress_model), and compressed checkpoints (the storage level).

    import kvzip.weights as kw
    zl = kw.ZipLinear.from_linear(linear)   # nn.Linear -> compressed, same forward
    model = kw.compress_model(model)        # every eligible Linear replaced
    w = zl.decompress_weight()              # bit-identical to linear.weight
    kw.save_compressed(state_dict, "model.kvz.safetensors")   # every tensor, byte-exact
    tensors = kw.load_compressed("model.kvz.safetensors", device="cuda")

docs/weights.md is the guide, docs/weights-format.md the byte layouts.
"""
from .checkpoint import load_compressed, save_compressed
from .linear import ZipLinear, compress_model, tiled_linear
from .tiled import TiledWeight

__all__ = ["TiledWeight", "ZipLinear", "compress_model", "load_compressed", "save_compressed", "tiled_linear"]
