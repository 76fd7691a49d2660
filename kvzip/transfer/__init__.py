"""kvzip.transfer: move KV caches between processes, compressed, through a transfer engine.

    from kvzip import transfer

    rx = transfer.Receiver(engine="mooncake", device="cuda")     # decode side; or device="cpu"
    tx = transfer.Sender(rx.address, engine="mooncake", codec="kvzip")   # prefill side
    h = tx.send("req-1", layers)          # layers: tensors or (k, v) tuples; returns at once
    h.wait()                              # the receiver has decoded it all; returns stats
    kv = rx.receive("req-1", timeout=30)  # same structure, dtypes and shapes; bit-identical

Streaming, while later layers are still computed: ``s = tx.begin("req-1", n_layers)``, then
``s.send_layer(i, k, v)`` per layer (or ``tx.send_layer(i, k, v)`` for the request this thread
began last), then ``s.wait()``.

Engines (kvzip/transfer/engines.py): "mooncake" (Mooncake Transfer Engine, peer to peer),
"torch" (torch.distributed: gloo for CPU memory, NCCL for GPU memory) and "loopback" (one
process; fault injection for tests).  The wire format and the pipelining are
in docs/transfer.md.
"""
from .codec import WireCodec, register as register_codec  # noqa: F401
from .engines import ENGINES, Engine, EngineError, Faults, LoopbackEngine, MooncakeEngine  # noqa: F401
from .pacing import Pacer  # noqa: F401
from .protocol import ProtocolError, TransferError  # noqa: F401
from .receiver import Receiver  # noqa: F401
from .sender import SendHandle, Sender  # noqa: F401

__all__ = ["Sender", "Receiver", "SendHandle", "TransferError", "ProtocolError", "Engine", "EngineError",
           "LoopbackEngine", "MooncakeEngine", "Faults", "ENGINES", "Pacer", "WireCodec", "register_codec"]
