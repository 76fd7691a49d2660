"""Hugging Face transformers (5.x) KV caches: compress, rebuild, and stream them.

    blobs = kvzip.hf.compress_cache(cache)          # one (k_blob, v_blob) pair per layer
    cache = kvzip.hf.decompress_cache(blobs)        # a DynamicCache, every bit as before

    layers = kvzip.hf.cache_to_layers(cache)        # [(k, v), ...]: what kvzip.transfer sends
    cache = kvzip.hf.layers_to_cache(layers)        # and what the decode side rebuilds

    stream = sender.begin("req-1", model.config.num_hidden_layers)
    cache = kvzip.hf.StreamingCache(stream)         # layer i leaves as soon as prefill writes it
    model(input_ids, **kvzip.hf.cache_kwargs(model, cache), use_cache=True)
    stream.wait()

``cache_kwargs`` names the cache the way the installed transformers wants it: ``cache=`` from
5.2x on, ``past_key_values=`` before (and a 5.x model silently ignores the other name, leaving
the cache it was given empty).

Only full-attention ``DynamicLayer`` layers are taken: their K/V tensors of shape
[batch, kv_heads, seq, head_dim] are the whole state of the layer, so a cache rebuilt from them
is the same cache.  Sliding-window, quantized, linear-attention and static layers keep state
outside those two tensors (a window offset, scales, recurrent states, a padded buffer) and are
refused with a TypeError rather than rebuilt subtly wrong.

This module imports transformers (``import kvzip`` does not); kvzip.compress itself refuses a
cache with a TypeError that points here.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

try:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
except ImportError as e:  # no transformers, or one older than the layered caches of 5.x
    raise ImportError(f"kvzip.hf needs transformers 5.x (pip install 'transformers>=5,<6'): {e}") from e

from . import api
from .pipeline import Pipeline

__all__ = ["cache_to_layers", "layers_to_cache", "compress_cache", "decompress_cache", "StreamingCache",
           "cache_kwargs", "output_cache"]


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for this model's forward and generate: the keyword its transformers
    version takes for the KV cache (``cache``, or ``past_key_values`` before the rename)."""
    return {_cache_keyword(type(model)): cache}


def output_cache(out):
    """The cache a forward returned, under either name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@lru_cache(maxsize=None)
def _cache_keyword(model_type) -> str:
    params = inspect.signature(model_type.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{model_type.__name__}.forward takes neither cache= nor past_key_values=")


def cache_to_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cache's (keys, values) per layer, the cache's own tensors (no copy).

    Raises TypeError for anything but a transformers Cache of full-attention DynamicLayer layers,
    ValueError for a layer that holds no KV yet (the model has not run on it)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not hasattr(cache, "get_seq_length"):
        raise TypeError(f"expected a transformers Cache (e.g. DynamicCache), got {type(cache).__name__}")
    if not layers:
        raise ValueError("the cache holds no layers yet: run the model on the prompt first")
    out = []
    for i, layer in enumerate(layers):
        # Exactly DynamicLayer: its subclasses (sliding window, quantized, hybrid) keep state beyond
        # keys/values, which a rebuilt DynamicLayer would not have.
        if type(layer) is not DynamicLayer:
            raise TypeError(f"layer {i} is a {type(layer).__name__}; kvzip.hf takes full-attention "
                            f"DynamicLayer layers only (a DynamicCache of a model without sliding-window, "
                            f"quantized or linear-attention layers)")
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            raise ValueError(f"layer {i} holds no KV yet: run the model on the prompt first")
        out.append((layer.keys, layer.values))
    _check_layers(out)
    return out


def layers_to_cache(layers) -> DynamicCache:
    """A DynamicCache holding these (keys, values) pairs, one per layer, in order.

    The cache holds the given tensors themselves, not copies (a decode node restores a long
    prompt's KV at no cost): DynamicLayer never writes its tensors in place (update, crop and
    reorder all make new ones), so generating from the cache leaves them as they were.  Each pair
    must be two 4-D torch tensors [batch, kv_heads, seq, head_dim] of one dtype and device, and all
    layers must agree on batch and sequence length (a model reads one position count off the cache)."""
    if isinstance(layers, (torch.Tensor, str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"expected a list of (keys, values) pairs, got {type(layers).__name__}")
    pairs = []
    for i, pair in enumerate(layers):
        if isinstance(pair, torch.Tensor) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(f"layer {i}: expected a (keys, values) pair of tensors, got {_describe(pair)}")
        pairs.append((pair[0], pair[1]))
    if not pairs:
        raise ValueError("no layers to build a cache from")
    _check_layers(pairs)
    # The constructor makes one empty DynamicLayer per (None, None) entry and a cache of exactly
    # that many layers (a model with more layers fails on it rather than finding empty ones).
    cache = DynamicCache([(None, None)] * len(pairs))
    for layer, (k, v) in zip(cache.layers, pairs):
        layer.lazy_initialization(k, v)  # device, dtype, is_initialized: as on a first update
        layer.keys, layer.values = k, v  # where that first update would store a copy (cat onto empty)
    return cache


def _check_layers(pairs: list) -> None:
    batch_seq = None
    for i, (k, v) in enumerate(pairs):
        for name, t in (("keys", k), ("values", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"layer {i}: {name} is a {type(t).__name__}, not a torch tensor")
            if t.ndim != 4:
                raise ValueError(f"layer {i}: {name} has shape {tuple(t.shape)}; a KV cache layer is "
                                 f"[batch, kv_heads, seq, head_dim]")
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError(f"layer {i}: keys are {k.dtype} on {k.device}, values {v.dtype} on {v.device}")
        # Values may have their own head_dim (some architectures do); batch, heads, seq must agree.
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} differ "
                             f"in batch, heads or sequence length")
        here = (k.shape[0], k.shape[2])
        if batch_seq is None:
            batch_seq = here
        elif here != batch_seq:
            raise ValueError(f"layer {i} holds batch {here[0]} x {here[1]} positions, layer 0 "
                             f"{batch_seq[0]} x {batch_seq[1]}; a cache's layers must agree")


def _describe(x) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def compress_cache(cache, pipeline: Pipeline | None = None, **compress_kwargs) -> list[tuple]:
    """One (k_blob, v_blob) pair per layer of a transformers cache.

    All tensors go through one ``compress_many`` call (one set of launches on a GPU).  pipeline:
    a kvzip.Pipeline to encode with; otherwise compress_kwargs are kvzip.compress_many's
    (codebook, checksum, chunk, backend).  Blobs are torch uint8 tensors on the cache's device."""
    if pipeline is not None and compress_kwargs:
        raise TypeError(f"pass either a pipeline or compress() options, not both "
                        f"(got {sorted(compress_kwargs)})")
    layers = cache_to_layers(cache)
    flat = [t for pair in layers for t in pair]
    blobs = pipeline.encode_many(flat) if pipeline is not None else api.compress_many(flat, **compress_kwargs)
    return [(blobs[2 * i], blobs[2 * i + 1]) for i in range(len(layers))]


def decompress_cache(blobs, *, backend: str | None = None) -> DynamicCache:
    """The DynamicCache compress_cache's pairs came from, bit for bit (blobs are self-describing).

    Raises kvzip.FormatError for a malformed or corrupted blob."""
    if isinstance(blobs, (torch.Tensor, str, bytes)) or not isinstance(blobs, Sequence):
        raise TypeError(f"expected the list of (k_blob, v_blob) pairs compress_cache returns, "
                        f"got {type(blobs).__name__}")
    flat = []
    for i, pair in enumerate(blobs):
        if isinstance(pair, (torch.Tensor, str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(f"layer {i}: expected a (k_blob, v_blob) pair, got {_describe(pair)}")
        flat.extend(pair)
    tensors = [_as_torch(t) for t in api.decompress_many(flat, backend=backend)]
    return layers_to_cache([(tensors[2 * i], tensors[2 * i + 1]) for i in range(len(blobs))])


def _as_torch(x) -> torch.Tensor:
    """A decoded tensor as torch.  Blobs given as bytes or NumPy decode to NumPy, where bfloat16
    and FP8 are ml_dtypes types that torch.from_numpy refuses: they cross as same-width integers
    and are reinterpreted, which moves no bit."""
    if isinstance(x, torch.Tensor):
        return x
    dtype = getattr(torch, getattr(getattr(x, "dtype", None), "name", ""), None)
    if not isinstance(x, np.ndarray) or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"decompress_cache rebuilds torch tensors from torch or NumPy blobs; the blobs "
                        f"decoded to {type(x).__name__} of dtype {getattr(x, 'dtype', None)}")
    bits = np.ascontiguousarray(x).view(f"i{x.dtype.itemsize}")
    return torch.from_numpy(bits).view(dtype)


class StreamingCache(DynamicCache):
    """A DynamicCache that hands each layer's complete K/V to a transfer stream as prefill writes it.

    stream: anything with ``send_layer(i, keys, values)``, e.g. ``Sender.begin(request, n_layers)``.
    tokens: the prompt length, when prefill runs in several forward calls (chunked prefill); a layer
    is then sent when it holds exactly that many positions.  None: a layer is sent on its first
    update, i.e. after one forward over the whole prompt.

    Each layer is sent once, in the order the model updates it (0, 1, ...), so layer i is on the
    wire while layers i+1... are still computed.  The tensors handed over are never written again:
    DynamicLayer.update makes new tensors by concatenation, so later updates (decoding more tokens
    locally) leave what was sent alone, and are not sent.  The caller still waits on the stream
    (``stream.wait()``) and checks ``complete`` (every layer sent).
    """

    def __init__(self, stream, *, tokens: int | None = None):
        if not callable(getattr(stream, "send_layer", None)):
            raise TypeError(f"stream must have send_layer(i, keys, values) (kvzip.transfer.Sender.begin "
                            f"returns one), got {type(stream).__name__}")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"tokens must be a positive int (the prompt length) or None, got {tokens!r}")
        super().__init__()  # layers appended lazily as DynamicLayer, one per layer index updated
        self.stream = stream
        self.tokens = tokens
        self.sent: list[int] = []  # layer indices in the order they were handed to the stream
        self._sent = set()

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx not in self._sent:
            held = keys.shape[-2]
            if self.tokens is not None and held > self.tokens:
                raise ValueError(f"layer {layer_idx} went from fewer than tokens={self.tokens} positions "
                                 f"to {held} in one update; chunk the prompt so a chunk ends at {self.tokens}")
            if self.tokens is None or held == self.tokens:
                self._sent.add(layer_idx)
                self.sent.append(layer_idx)
                self.stream.send_layer(layer_idx, keys, values)
        return keys, values

    @property
    def complete(self) -> bool:
        """Every layer the cache holds has been handed to the stream."""
        return bool(self.layers) and len(self._sent) == len(self.layers)
