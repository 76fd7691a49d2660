"""kvzip.hf: transformers caches compressed, rebuilt and streamed, every bit preserved.

Needs torch and transformers (skipped without them).  The model tests use a tiny random Llama
(built from a config, no download); the real SmolLM2 run is tests/test_pd_demo.py.
"""
import subprocess
import sys
from importlib import resources

import numpy as np
import pytest

import kvzip
from kvzip.testing import as_torch, assert_bits_equal, kv_like_bits, special_values

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("kvzip.hf")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402


def _cuda_ready() -> bool:
    try:
        import cupy  # noqa: F401  kvzip's GPU path

        return torch.cuda.is_available()
    except ImportError:
        return False


DEVICES = ["cpu"] + (["cuda"] if _cuda_ready() else [])


def _tiny_model(layers=3, seed=0):
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _prompt(n=40, seed=1):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill(model, ids):
    with torch.inference_mode():
        out = model(input_ids=ids, **hf.cache_kwargs(model, DynamicCache()), use_cache=True)
    return hf.output_cache(out), out.logits


def _real_kv_layers():
    """SmolLM2-135M's prose KV shipped in kvzip.data: 30 layers of [1, 3, 128, 64] bfloat16."""
    with resources.files("kvzip.data").joinpath("kv_sample.npz").open("rb") as f:
        data = np.load(f)
        return [tuple(as_torch(data[f"prose/layer{i:02d}.{n}"], "bfloat16")[None] for n in "kv")
                for i in range(30)]


def _assert_same_layers(got, want):
    assert len(got) == len(want)
    for i, ((gk, gv), (wk, wv)) in enumerate(zip(got, want)):
        assert_bits_equal(gk, wk, f"layer {i} keys:")
        assert_bits_equal(gv, wv, f"layer {i} values:")


def test_import_kvzip_leaves_transformers_alone():
    code = "import sys, kvzip; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_compress_of_a_cache_points_to_kvzip_hf():
    cache, _ = _prefill(_tiny_model(), _prompt())
    with pytest.raises(TypeError, match=r"kvzip\.hf\.compress_cache"):
        kvzip.compress(cache)

    class Stream:
        def send_layer(self, i, k, v):
            pass

    with pytest.raises(TypeError, match=r"kvzip\.hf"):  # a subclass defined outside transformers
        kvzip.compress(hf.StreamingCache(Stream()))


@pytest.mark.parametrize("device", DEVICES)
def test_real_kv_round_trips_through_layers_and_blobs(device):
    layers = [(k.to(device), v.to(device)) for k, v in _real_kv_layers()]
    cache = hf.layers_to_cache(layers)
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 128
    _assert_same_layers(hf.cache_to_layers(cache), layers)
    blobs = hf.compress_cache(cache)
    assert len(blobs) == 30 and all(len(p) == 2 and p[0].device == layers[0][0].device for p in blobs)
    raw = sum(k.numel() * 2 + v.numel() * 2 for k, v in layers)
    packed = sum(b.numel() for p in blobs for b in p)
    assert packed < raw / 1.25, f"real SmolLM2 KV compressed only {raw / packed:.3f}x"
    _assert_same_layers(hf.cache_to_layers(hf.decompress_cache(blobs)), layers)


def test_layers_to_cache_holds_the_tensors_and_generation_never_writes_them():
    model, ids = _tiny_model(), _prompt()
    cache, logits = _prefill(model, ids)
    layers = [(k.clone(), v.clone()) for k, v in hf.cache_to_layers(cache)]
    before = [(k.clone(), v.clone()) for k, v in layers]
    rebuilt = hf.layers_to_cache(layers)
    assert all(a is k and b is v for (a, b), (k, v) in zip(hf.cache_to_layers(rebuilt), layers))
    with torch.inference_mode():
        first = logits[:, -1].argmax(-1, keepdim=True)
        model.generate(torch.cat([ids, first], 1), **hf.cache_kwargs(model, rebuilt), max_new_tokens=3, do_sample=False)
    assert rebuilt.get_seq_length() == ids.shape[1] + 3
    _assert_same_layers(layers, before)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_bit_pattern_survives(dtype):
    """Special values (NaN payloads, -0, Inf, subnormals) and escape-heavy KV in all layers."""
    specials = special_values(dtype)
    layers = []
    for i in range(4):
        bits = kv_like_bits(dtype, 2 * 3 * 17 * 8, escape_rate=0.05, seed=i)
        bits[: specials.size] = specials
        t = as_torch(bits, dtype).reshape(2, 3, 17, 8)
        layers.append((t, t.flip(-1).clone()))
    cache = hf.layers_to_cache(layers)
    for kwargs in ({}, {"checksum": True}, {"pipeline": kvzip.splitzip_pipeline(checksum=True)}):
        _assert_same_layers(hf.cache_to_layers(hf.decompress_cache(hf.compress_cache(cache, **kwargs))), layers)


def test_blobs_given_as_bytes_rebuild_torch_tensors():
    layers = _real_kv_layers()[:3]
    blobs = [tuple(bytes(b.numpy()) for b in pair) for pair in hf.compress_cache(hf.layers_to_cache(layers))]
    _assert_same_layers(hf.cache_to_layers(hf.decompress_cache(blobs)), layers)


def test_a_corrupted_blob_raises_format_error():
    blobs = hf.compress_cache(hf.layers_to_cache(_real_kv_layers()[:2]), checksum=True)
    bad = blobs[1][0].clone()
    bad[bad.numel() // 2] ^= 0x10
    with pytest.raises(kvzip.FormatError):
        hf.decompress_cache([blobs[0], (bad, blobs[1][1])])


def test_generation_from_a_rebuilt_cache_matches():
    """Greedy tokens continuing from decompress_cache(compress_cache(prefill)) equal one
    generate() call over the prompt: the rebuilt cache is the prefill's cache."""
    model, ids = _tiny_model(), _prompt()
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
        cache, logits = _prefill(model, ids)
        rebuilt = hf.decompress_cache(hf.compress_cache(cache))
        first = logits[:, -1].argmax(-1, keepdim=True)
        got = model.generate(torch.cat([ids, first], 1), **hf.cache_kwargs(model, rebuilt), max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)


class _Recorder:
    """A send stream that records what was sent, and how far the model had got at the time."""

    def __init__(self):
        self.cache = None
        self.sent = []  # (layer index, keys, values, layers the cache held at that moment)

    def send_layer(self, i, k, v):
        self.sent.append((i, k, v, len(self.cache.layers)))


def test_streaming_cache_sends_each_layer_once_as_prefill_writes_it():
    model, ids = _tiny_model(layers=4), _prompt(33)
    rec = _Recorder()
    rec.cache = cache = hf.StreamingCache(rec)
    with torch.inference_mode():
        got = model.generate(ids, **hf.cache_kwargs(model, cache), max_new_tokens=4, do_sample=False)
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
        reference, _ = _prefill(model, ids)
    assert torch.equal(got, want)  # the streaming cache is an ordinary cache to the model
    assert [s[0] for s in rec.sent] == [0, 1, 2, 3] and cache.sent == [0, 1, 2, 3] and cache.complete
    # layer i left while layers i+1... did not exist yet: the send overlaps prefill compute
    assert [s[3] for s in rec.sent] == [1, 2, 3, 4]
    # what was sent is the prompt's KV, untouched by the three decode steps that followed
    _assert_same_layers([(k, v) for _, k, v, _ in rec.sent], hf.cache_to_layers(reference))
    assert cache.get_seq_length() == 33 + 3


def test_streaming_cache_waits_for_the_whole_prompt_in_chunked_prefill():
    model, ids = _tiny_model(), _prompt(30)
    rec = _Recorder()
    rec.cache = cache = hf.StreamingCache(rec, tokens=30)
    with torch.inference_mode():
        model(input_ids=ids[:, :12], **hf.cache_kwargs(model, cache), use_cache=True)
        assert rec.sent == []
        model(input_ids=ids[:, 12:], **hf.cache_kwargs(model, cache), use_cache=True)
        reference, _ = _prefill(model, ids)
    assert [s[0] for s in rec.sent] == [0, 1, 2]
    sent = [(k, v) for _, k, v, _ in rec.sent]
    # chunked and one-shot prefill may round differently; the sent KV is the cache's own
    _assert_same_layers(sent, hf.cache_to_layers(cache))
    assert all(k.shape == r.shape for (k, _), (r, _) in zip(sent, hf.cache_to_layers(reference)))

    over = hf.StreamingCache(_Recorder(), tokens=20)
    with torch.inference_mode(), pytest.raises(ValueError, match="chunk the prompt"):
        model(input_ids=ids, **hf.cache_kwargs(model, over), use_cache=True)


def test_bad_caches_and_layers_are_refused():
    with pytest.raises(ValueError, match="no layers"):
        hf.cache_to_layers(DynamicCache())
    with pytest.raises(TypeError, match="transformers Cache"):
        hf.cache_to_layers([(torch.zeros(1), torch.zeros(1))])
    sliding = DynamicCache()
    sliding.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    sliding.layers[0].update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(TypeError, match="DynamicSlidingWindowLayer"):
        hf.cache_to_layers(sliding)
    with pytest.raises(TypeError, match="either a pipeline"):
        hf.compress_cache(DynamicCache(), checksum=True, pipeline=kvzip.splitzip_pipeline())

    k = torch.zeros(1, 2, 5, 8, dtype=torch.bfloat16)
    for bad, err, msg in [
        (k, TypeError, "list of"),
        ([], ValueError, "no layers"),
        ([k], TypeError, "pair"),
        ([(k, k, k)], TypeError, "pair"),
        ([(k, np.zeros((1, 2, 5, 8)))], TypeError, "not a torch tensor"),
        ([(k[0], k[0])], ValueError, "batch, kv_heads, seq, head_dim"),
        ([(k, k.float())], ValueError, "keys are torch.bfloat16"),
        ([(k, k[:, :, :4])], ValueError, "differ"),
        ([(k, k), (k[:, :, :4], k[:, :, :4])], ValueError, "must agree"),
    ]:
        with pytest.raises(err, match=msg):
            hf.layers_to_cache(bad)
    with pytest.raises(TypeError, match="pairs"):
        hf.decompress_cache(b"not a list")
    with pytest.raises(TypeError, match="pair"):
        hf.decompress_cache([b"one blob"])
    with pytest.raises(TypeError, match="send_layer"):
        hf.StreamingCache(object())
    for tokens in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="tokens"):
            hf.StreamingCache(_Recorder(), tokens=tokens)


@pytest.mark.parametrize("device", DEVICES)
def test_streaming_cache_through_a_transfer_rebuilds_the_prefill_cache(device):
    """Prefill streams into a real Sender (loopback engine, kvzip codec); the receiver's layers
    become a cache whose greedy continuation equals one generate() over the prompt."""
    transfer = pytest.importorskip("kvzip.transfer")
    model, ids = _tiny_model(layers=5).to(device), _prompt(64).to(device)
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=5, do_sample=False)
    with transfer.Receiver(engine="loopback", device=device, slot_bytes=1 << 16) as rx, \
            transfer.Sender(rx.address, engine="loopback", codec="kvzip", group_bytes=1 << 12) as tx:
        stream = tx.begin("r", 5)
        cache = hf.StreamingCache(stream)
        with torch.inference_mode():
            logits = model(input_ids=ids, **hf.cache_kwargs(model, cache), use_cache=True).logits
        stats = stream.wait(timeout=60)
        assert cache.complete and stats["groups"] > 1  # several messages: layers left one group at a time
        rebuilt = hf.layers_to_cache(rx.receive("r", timeout=60))
    _assert_same_layers(hf.cache_to_layers(rebuilt), hf.cache_to_layers(cache))
    first = logits[:, -1].argmax(-1, keepdim=True)
    with torch.inference_mode():
        got = model.generate(torch.cat([ids, first], 1), **hf.cache_kwargs(model, rebuilt), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
