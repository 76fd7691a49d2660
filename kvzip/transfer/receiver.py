"""The decode side: a registered receive ring, and requests rebuilt from its slots.

The ring is ``slots`` slots of ``slot_bytes`` in registered memory (the CPU, or one plain
cudaMalloc on a GPU).  Each connected sender owns ``slots // max_senders`` of them and may write
into a slot only while it holds that slot's credit; the receiver returns the credit once it has
decoded the slot's message into new memory.  So memory is bounded by the ring plus the decoded
tensors (held until ``receive`` takes them), however many messages are in flight, and a slow
decoder slows the sender (backpressure) instead of being overrun.

Threads: one accepting connections; per connection one reader that decodes each ``data``
message as it reads it (slot -> tensors, on its own CUDA stream on a GPU) and returns the slot's
credit.  Message i+1's bytes still arrive while i decodes: the engine writes them into the ring
without this thread, and their control message waits in the socket.  ``close`` returns once
every one of these threads has ended.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from ..checksum import sum64_finish
from ..errors import FormatError
from . import codec
from .buffers import Buffer
from .codec import now
from .engines import make_engine
from .protocol import VERSION, Channel, ProtocolError, TransferError, check_data

log = logging.getLogger("kvzip.transfer")

DEFAULT_SLOT = {"cpu": 32 << 20, "cuda": 64 << 20}
TIMELINE_MESSAGES = 1024  # a request's first messages whose marks go back in "done" (~150 bytes each,
                          # well inside protocol.MAX_FRAME)
DEFAULT_SLOTS = 4


class _Incoming:
    """One request's state on the receiver."""

    def __init__(self, req: str):
        self.req = req
        self.n_layers: int | None = None
        self.layers: dict[int, object] = {}
        self.ended = False
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.abandoned = False
        self.conn: "_Connection | None" = None
        self.decode_s = 0.0
        self.timeline: list[dict] = []  # per message: perf_counter marks of its arrival and decode

    def complete(self) -> bool:
        return self.ended and self.n_layers is not None and len(self.layers) == self.n_layers


class Receiver:
    """Receives requests' KV from Senders.

    engine: "mooncake" (two processes or hosts) or "loopback" (one process), or an Engine.
    device: where the ring lives and the tensors arrive ("cpu", "cuda", "cuda:1").
    slot_bytes: the largest message (group of layers, raw bytes); ring_bytes: the whole ring
    (default four slots).  host / port: where to listen for senders (port 0: any free one).
    """

    def __init__(self, *, engine="mooncake", device: str = "cpu", slot_bytes: int | None = None,
                 ring_bytes: int | None = None, max_senders: int = 1, host: str = "127.0.0.1", port: int = 0):
        if device != "cpu" and not device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:i]', got {device!r}")
        if device == "cuda":
            device = "cuda:0"
        kind = "cpu" if device == "cpu" else "cuda"
        slot_bytes = DEFAULT_SLOT[kind] if slot_bytes is None else slot_bytes
        if type(slot_bytes) is not int or slot_bytes < 1 << 16 or slot_bytes % 256:
            raise ValueError(f"slot_bytes must be a multiple of 256 of at least 64 KiB, got {slot_bytes!r}")
        ring_bytes = DEFAULT_SLOTS * slot_bytes if ring_bytes is None else ring_bytes
        if type(max_senders) is not int or max_senders < 1:
            raise ValueError(f"max_senders must be a positive int, got {max_senders!r}")
        if type(ring_bytes) is not int or ring_bytes // slot_bytes < 2 * max_senders:
            raise ValueError(f"ring_bytes {ring_bytes!r} holds fewer than two slots of {slot_bytes} bytes "
                             f"per sender (max_senders={max_senders}): a sender could not overlap two messages")
        self.device, self.slot_bytes = device, slot_bytes
        self.slots = ring_bytes // slot_bytes
        self._engine = make_engine(engine)
        self._ring = Buffer(self.slots * slot_bytes, device)
        try:
            self._engine.register(self._ring.ptr, self._ring.nbytes, device)
            self._listener = socket.create_server((host, port))
        except BaseException:
            self._engine.close()
            raise
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._windows = [list(range(i * (self.slots // max_senders), (i + 1) * (self.slots // max_senders)))
                         for i in range(max_senders)]
        self._requests: dict[str, _Incoming] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._connections: list[_Connection] = []
        self._readers: list[threading.Thread] = []  # every connection's reader not known to have ended:
                                                    # close() joins them, also those whose connection already closed
        self._acceptor = threading.Thread(target=self._accept, name="kvzip-rx-accept", daemon=True)
        self._acceptor.start()

    # ------------------------------------------------------------------ public API
    def receive(self, request: str, timeout: float | None = 30.0, n_layers: int | None = None) -> list:
        """The request's layers, as sent (a tensor or a tuple per layer), bit-identical, on this
        receiver's device.  Raises TimeoutError after ``timeout`` seconds (the request is then
        dropped: later messages for it are discarded), TransferError if its sender failed or went
        away, kvzip.FormatError if a message was corrupted, ValueError if ``n_layers`` is given
        and the sender's manifest says otherwise."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            inc = self._requests.setdefault(request, _Incoming(request))
        if not inc.done.wait(None if deadline is None else max(deadline - time.monotonic(), 0)):
            self._drop(inc, TimeoutError(f"request {request!r} not received within {timeout} s"))
            raise TimeoutError(f"request {request!r} not received within {timeout} s")
        with self._cond:
            self._requests.pop(request, None)
        if inc.error is not None:
            raise inc.error
        if n_layers is not None and n_layers != inc.n_layers:
            raise ValueError(f"request {request!r} has {inc.n_layers} layers, the caller expected {n_layers}")
        layers = [inc.layers[i] for i in range(inc.n_layers)]
        if self.device != "cpu":
            _hand_over(layers)
        return layers

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:  # shutdown wakes the acceptor's accept(); close alone would not
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._acceptor.join(timeout=5)  # no connection comes after this
        with self._lock:
            connections = list(self._connections)
        for c in connections:
            c.close(TransferError("the receiver was closed"))
        # The readers end once their channels are closed; one still running at interpreter exit
        # (it decodes on the GPU) would be torn down inside CUDA or torch code.  Every reader is
        # joined, not only those of the connections still listed: a connection its sender closed
        # has left the list while its reader may still be winding down.
        with self._lock:
            readers = list(self._readers)
        for t in readers:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=5)
        with self._cond:
            pending = list(self._requests.values())
        for inc in pending:
            self._finish(inc, TransferError("the receiver was closed"))
        self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(not inc.done.is_set() for inc in self._requests.values())

    # ------------------------------------------------------------------ internals
    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            chan = Channel(sock)
            with self._lock:
                window = next((w for w in self._windows if not any(c.window is w for c in self._connections)), None)
            ring = {"base": self._ring.ptr + (window[0] if window else 0) * self.slot_bytes,
                    "slot_bytes": self.slot_bytes, "slots": len(window) if window else 1}
            hello = {"version": VERSION, "engine": self._engine.name, "session": self._engine.session,
                     "device": self.device, "ring": ring}
            try:
                if window is None:
                    chan.send("hello", refused=f"receiver already serves its max_senders={len(self._windows)} senders", **hello)
                    chan.close()
                    continue
                conn = _Connection(self, chan, window)
                with self._lock:
                    self._connections.append(conn)
                chan.send("hello", **hello)
            except TransferError:
                chan.close()
                continue
            with self._lock:
                self._readers = [t for t in self._readers if t.is_alive()] + [conn.thread]
            conn.start()

    def _incoming(self, req: str) -> _Incoming:
        with self._cond:
            return self._requests.setdefault(req, _Incoming(req))

    def _finish(self, inc: _Incoming, error: BaseException | None) -> None:
        if not inc.done.is_set():
            inc.error = error
            if error is not None:
                inc.layers.clear()  # free what was decoded: nobody will get it
            inc.done.set()

    def _drop(self, inc: _Incoming, error: BaseException) -> None:
        inc.abandoned = True
        self._finish(inc, error)
        with self._cond:
            self._requests.pop(inc.req, None)
        if inc.conn is not None:
            inc.conn.send_quietly("failed", req=inc.req, why=f"receiver gave up: {error}", error=type(error).__name__)


def _check_digest(total, msg: dict) -> None:
    got = f"{sum64_finish(total, msg['nbytes']):016x}"
    if got != msg["digest"]:
        raise FormatError(f"message of request {msg['req']!r} in slot {msg['slot']} is corrupted: "
                          f"digest {got}, the sender's {msg['digest']}")


def _hand_over(layers) -> None:
    """The tensors were written on the receiver's decode stream (and synchronised); record them
    on the caller's current stream too, so that torch's caching allocator does not give their
    memory to a later decode while the caller's queued work still reads them."""
    import torch

    stream = torch.cuda.current_stream()
    for layer in layers:
        for t in layer if isinstance(layer, tuple) else (layer,):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(stream)


class _Connection:
    """One sender's control connection and its window of the ring."""

    def __init__(self, rx: Receiver, chan: Channel, window: list[int]):
        self.rx, self.chan, self.window = rx, chan, window
        self._requests: dict[str, _Incoming] = {}
        self._closed = False
        self.thread = threading.Thread(target=self._guard, args=(self._read,), name="kvzip-rx-read", daemon=True)
        self._stream = None
        if rx.device != "cpu":
            import torch

            self._stream = torch.cuda.Stream(device=rx.device)

    def start(self) -> None:
        self.thread.start()

    def _guard(self, stage) -> None:
        try:
            stage()
        except BaseException as e:  # noqa: BLE001  the connection ends; its requests fail with e
            if not self._closed:
                log.warning("kvzip receiver: connection %s ends: %s", stage.__name__, e)
            self.close(e if isinstance(e, TransferError) else TransferError(f"{type(e).__name__}: {e}"))

    def _read(self) -> None:
        if self._stream is not None:  # this thread's current device and stream, once: each
            import torch              # message's decode then runs on them without a context

            torch.cuda.set_device(self._stream.device)
            torch.cuda.set_stream(self._stream)
        slots = len(self.window)
        while True:
            msg = self.chan.recv()
            if msg is None:
                if self._requests:
                    raise TransferError("the sender went away (control connection closed) before its requests completed")
                self.close(TransferError("the sender closed the connection"))
                return
            kind, req = msg["kind"], msg.get("req")
            if kind == "begin":
                self._begin(msg)
            elif kind == "data":
                check_data(msg, slots, self.rx.slot_bytes, codec.known())
                self._decode(msg, now())
            elif kind == "end":  # after the request's data messages, all decoded by now
                inc = self._requests.get(req)
                if inc is not None and not inc.done.is_set():
                    inc.ended = True
                    self._settle(inc)
            elif kind == "cancel":
                inc = self._requests.pop(req, None)
                if inc is not None:
                    inc.abandoned = True
                    self.rx._finish(inc, TransferError(f"request {req!r} was cancelled by its sender"))
            else:
                raise ProtocolError(f"unexpected {kind!r} message from a sender")

    def _begin(self, msg: dict) -> None:
        req, n = msg.get("req"), msg.get("n_layers")
        if type(req) is not str or not 0 < len(req) <= 256 or type(n) is not int or not 0 < n <= 1 << 20:
            raise ProtocolError(f"malformed begin message: {str(msg)[:120]}")
        inc = self.rx._incoming(req)
        if inc.n_layers is not None or inc.done.is_set():
            self.send_quietly("reject", req=req, why="a request of that id is already being received")
            return
        inc.n_layers, inc.conn = n, self
        self._requests[req] = inc
        self.chan.send("accept", req=req)

    def _decode(self, msg: dict, received: float) -> None:
        """The message's tensors into its request, then the slot's credit back, whatever happened."""
        inc = self._requests.get(msg["req"])
        try:
            if inc is not None and not inc.abandoned and not inc.done.is_set():
                marks = {"received": received, "decode_from": now()}
                self._store(inc, msg, marks)
                marks["decoded"] = now()
                inc.decode_s += marks["decoded"] - marks["decode_from"]
                if len(inc.timeline) < TIMELINE_MESSAGES:
                    inc.timeline.append(marks)
        except FormatError as e:
            self._fail(inc, e, "FormatError")
        except (ProtocolError, TypeError, ValueError) as e:
            self._fail(inc, e, type(e).__name__)
        finally:
            self.chan.send("credit", slot=msg["slot"])

    def _store(self, inc: _Incoming, msg: dict, marks: dict) -> None:
        base = (self.window[0] + msg["slot"]) * self.rx.slot_bytes
        entries = [e for layer in msg["layers"] for e in layer["tensors"]]
        ring = self.rx._ring

        def verify(total):
            if self._stream is not None:
                self._stream.synchronize()
            _check_digest(total, msg)

        if self._stream is None:  # codec.unpack verified the digest before decoding
            tensors, _ = codec.unpack(ring, base, msg["nbytes"], entries, "cpu", verify)
            marks["unpacked"] = now()
        else:  # on this thread's current stream, the connection's (_read)
            tensors, total = codec.unpack(ring, base, msg["nbytes"], entries, self.rx.device, verify, self._stream)
            marks["unpacked"] = now()
            verify(total)  # the slot is read and the tensors written before the credit goes back
        k = 0
        for layer in msg["layers"]:
            i, n = layer["index"], len(layer["tensors"])
            if i >= inc.n_layers or i in inc.layers:
                raise ProtocolError(f"layer {i} of request {inc.req!r} is outside its {inc.n_layers} layers or sent twice")
            if n != 1 and layer.get("tuple") is not True or n == 1 and layer.get("tuple") not in (True, False):
                raise ProtocolError(f"layer {i} of request {inc.req!r} has a malformed structure")
            inc.layers[i] = tuple(tensors[k:k + n]) if layer["tuple"] else tensors[k]
            k += n

    def _settle(self, inc: _Incoming) -> None:
        self._requests.pop(inc.req, None)
        if inc.complete():
            self.rx._finish(inc, None)
            self.send_quietly("done", req=inc.req, decode_s=inc.decode_s, timeline=inc.timeline)
        else:
            missing = inc.n_layers - len(inc.layers)
            self._fail(inc, ProtocolError(f"request {inc.req!r} ended with {missing} of its {inc.n_layers} layers missing"),
                       "ProtocolError")

    def _fail(self, inc: _Incoming | None, error: BaseException, name: str) -> None:
        if inc is None:
            return
        log.warning("kvzip receiver: request %s failed: %s", inc.req, error)
        self._requests.pop(inc.req, None)
        self.rx._finish(inc, error)
        self.send_quietly("failed", req=inc.req, why=str(error), error=name)

    def send_quietly(self, kind: str, **fields) -> None:
        try:
            self.chan.send(kind, **fields)
        except TransferError:
            pass

    def close(self, error: BaseException) -> None:
        if self._closed:
            return
        self._closed = True
        with self.rx._lock:  # the window is free before anyone hears of the failure
            if self in self.rx._connections:
                self.rx._connections.remove(self)
        self.chan.close()
        for inc in list(self._requests.values()):
            self.rx._finish(inc, error)
        self._requests.clear()
