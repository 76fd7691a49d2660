"""The control channel: length-prefixed JSON messages over one TCP connection per sender.

Bulk bytes go through the engine (one-sided writes into the receiver's ring); everything else goes
here, in order.  A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON,
an object with a ``"kind"`` field.  Frames over MAX_FRAME bytes are refused before they are read.

    receiver -> sender   hello   {version, engine, session, device, ring: {base, slot_bytes, slots}}
    sender -> receiver   begin   {req, n_layers, codec}
    receiver -> sender   accept  {req}  |  reject {req, why}
    sender -> receiver   data    {req, slot, nbytes, digest, layers: [{index, tuple, tensors: [TensorEntry]}]}
    receiver -> sender   credit  {slot}                    the slot is free again
    sender -> receiver   end     {req, layers}              every layer of req was sent
    receiver -> sender   done    {req, decode_s, timeline}  |  failed {req, why, error}
    sender -> receiver   cancel  {req}

A TensorEntry is {framework, dtype, shape, offset, nbytes, codec}: the tensor's bytes (a kvzip
blob when codec is "kvzip", its raw bytes when "raw", else a registered WireCodec's encoding)
lie at ``offset`` in the slot.  A slot
holds one group of layers; ``digest`` is kvzip's sum64 (kvzip/checksum.py) of the message's
nbytes bytes, as 16 hex digits, checked by the receiver before it hands any tensor out.
docs/transfer.md gives the whole exchange.
"""
from __future__ import annotations

import json
import math
import socket
import struct
import threading

VERSION = 1
MAX_FRAME = 1 << 20
_LENGTH = struct.Struct(">I")
ALIGN = 256  # tensors start at multiples of this in a slot (kvzip blobs need 16; CUDA copies like 256)

KINDS = {"hello", "begin", "accept", "reject", "data", "credit", "end", "done", "failed", "cancel"}
FRAMEWORKS = {"torch", "numpy"}


class TransferError(RuntimeError):
    """A transfer failed: the peer went away, timed out, refused the request or broke the protocol."""


class ProtocolError(TransferError):
    """A peer sent a message that breaks the protocol (the connection is closed)."""


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Channel:
    """One control connection: thread-safe send, one reader thread calling recv."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, kind: str, **fields) -> None:
        body = json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()
        if len(body) > MAX_FRAME:
            raise ProtocolError(f"a {kind!r} message of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame limit")
        with self._send_lock:
            try:
                self.sock.sendall(_LENGTH.pack(len(body)) + body)
            except OSError as e:
                raise TransferError(f"the peer closed the control connection ({e})") from e

    def recv(self) -> dict | None:
        """The next message, or None once the peer has closed the connection."""
        head = self._read(_LENGTH.size)
        if head is None:
            return None
        (n,) = _LENGTH.unpack(head)
        if n > MAX_FRAME:
            raise ProtocolError(f"control frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
        body = self._read(n)
        if body is None:
            return None
        try:
            msg = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ProtocolError(f"control frame is not JSON: {e}") from None
        if not isinstance(msg, dict) or msg.get("kind") not in KINDS:
            raise ProtocolError(f"control frame is not a known message: {str(msg)[:80]}")
        return msg

    def _read(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                part = self.sock.recv(n - len(buf))
            except OSError:
                return None
            if not part:
                return None
            buf += part
        return bytes(buf)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def parse_address(address: str) -> tuple[str, int]:
    if not isinstance(address, str) or address.count(":") != 1:
        raise ValueError(f"receiver address must be 'host:port', got {address!r}")
    host, port = address.split(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"receiver address {address!r} has no valid port")
    return host, int(port)


# ---- validation of what a peer sends: every field checked before it is used ------------------

def _int(v, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _str(v, what: str, choices=None) -> str:
    if type(v) is not str or len(v) > 256 or (choices is not None and v not in choices):
        raise ProtocolError(f"{what} is not a valid value: {str(v)[:80]!r}")
    return v


def check_hello(msg: dict) -> dict:
    if msg.get("kind") != "hello":
        raise ProtocolError(f"expected a hello, got {msg.get('kind')!r}")
    if msg.get("version") != VERSION:
        raise ProtocolError(f"peer speaks protocol version {msg.get('version')!r}, this kvzip speaks {VERSION}")
    ring = msg.get("ring")
    if not isinstance(ring, dict):
        raise ProtocolError("hello carries no ring")
    _int(ring.get("base"), 0, 2**64 - 1, "ring base")
    _int(ring.get("slot_bytes"), ALIGN, 2**48, "ring slot size")
    _int(ring.get("slots"), 1, 1 << 16, "ring slot count")
    _str(msg.get("session"), "engine session")
    _str(msg.get("engine"), "engine name")
    _str(msg.get("device"), "device")
    return msg


def _is_hex16(v) -> bool:
    return type(v) is str and len(v) == 16 and all(c in "0123456789abcdef" for c in v)


def check_data(msg: dict, slots: int, slot_bytes: int, codecs: set[str]) -> dict:
    """A data message's fields, checked against the ring (every tensor's bytes inside its slot,
    in order and without overlap) and the wire codecs known here."""
    _str(msg.get("req"), "request id")
    _int(msg.get("slot"), 0, slots - 1, "slot")
    nbytes = _int(msg.get("nbytes"), 0, slot_bytes, "message size")
    if nbytes % 8 or not _is_hex16(msg.get("digest")):
        raise ProtocolError("data message has no valid digest or a size that is not a multiple of 8")
    layers = msg.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ProtocolError("data message carries no layers")
    end = 0
    for layer in layers:
        if not isinstance(layer, dict) or not isinstance(layer.get("tensors"), list):
            raise ProtocolError("data message has a malformed layer")
        _int(layer.get("index"), 0, 1 << 20, "layer index")
        for t in layer["tensors"]:
            end = _tensor_end(t, end, nbytes, codecs)
    return msg


def _tensor_end(t, end: int, nbytes: int, codecs: set[str]) -> int:
    """Where a TensorEntry placed from ``end`` in a message of nbytes ends, once checked.  The
    receiver's reader checks every tensor of every message before decoding it, so the common,
    valid entry is judged by one expression; any other by the checks that say what is wrong."""
    if (type(t) is dict and type(fw := t.get("framework")) is str and fw in FRAMEWORKS
            and type(dt := t.get("dtype")) is str
            and len(dt) <= 256 and type(c := t.get("codec")) is str and c in codecs
            and type(shape := t.get("shape")) is list and len(shape) <= 16
            and all(type(s) is int and 0 <= s <= 2**48 for s in shape) and math.prod(shape) <= 2**48
            and type(off := t.get("offset")) is int and end <= off <= nbytes
            and type(n := t.get("nbytes")) is int and 0 <= n <= nbytes - off):
        return off + n
    if not isinstance(t, dict):
        raise ProtocolError("data message has a malformed tensor entry")
    _str(t.get("framework"), "framework", FRAMEWORKS)
    _str(t.get("dtype"), "dtype")
    _str(t.get("codec"), "codec", codecs)
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > 16:
        raise ProtocolError(f"tensor shape {str(shape)[:80]} is malformed")
    for s in shape:
        _int(s, 0, 2**48, "tensor dimension")
    if math.prod(shape) > 2**48:
        raise ProtocolError(f"tensor shape {shape} is too large")
    off = _int(t.get("offset"), end, nbytes, "tensor offset")
    return off + _int(t.get("nbytes"), 0, nbytes - off, "tensor size")
