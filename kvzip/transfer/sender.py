"""The prefill side: groups layers, compresses group i+1 while group i is on the wire.

Two threads a Sender:

    caller --(groups)--> pipeline: encode -> write -> notify, one group after another
                            ^                                     |
    reader <--(credits, accept, done, failed)-- receiver <--(data)+

- the caller's ``send`` / ``send_layer`` only queue work (a CUDA caller's tensors are fenced by
  an event on its current stream, so the encode's side stream waits for them);
- the pipeline takes each group in order: it compresses the group (on its own CUDA stream on a
  GPU) straight into a free staging slot of registered memory, lands the previous group's write,
  takes a credit (a free slot of the receiver's ring) and starts this group's write through the
  engine (Engine.write_async), so group i+1 is encoded while group i is in flight; a landed
  write's ``data`` message goes out once the (possibly emulated, kvzip/transfer/pacing.py) link
  has delivered it, from whichever wait the pipeline is in at that moment;
- the reader applies the receiver's credits and verdicts.

One thread carries a group from encode to notice, so no group waits for another thread to be
woken and given the GIL between its steps (benchmarks/NOTES.md t13-t15).

Any failure (engine, control connection, protocol) fails every request in flight with one
TransferError and closes the Sender; ``close`` always unregisters its memory.
"""
from __future__ import annotations

import collections
import logging
import queue
import socket
import threading

from ..checksum import sum64_finish
from ..pipeline import Pipeline
from . import buffers, codec
from .buffers import Buffer
from .codec import AutoChooser, now
from .engines import EngineError, make_engine
from .pacing import Pacer, wait_until
from .protocol import Channel, ProtocolError, TransferError, check_hello, parse_address

log = logging.getLogger("kvzip.transfer")

MIN_GROUP = 8 << 20     # a compress call should carry a few MiB, or its fixed cost shows
TARGET_GROUPS = 8       # enough groups that the pipeline's fill is a small part of the time
STAGING_SLOTS = 2       # the group being encoded and the one whose write is in flight
FIRST_GROUP = 4 << 20   # the first group closes early, so the wire starts after a short encode;
                        # a large last layer travels alone, so the decode after the wire is short
PROBE_BYTES = 8 << 20   # an unpaced link's first measure: PROBE_WRITES writes of this (or a slot)
PROBE_WRITES = 2        # at staging, the last one timed
RECHECK_BELOW = 0.95  # codec="auto" re-chooses a request's later groups when one of its groups
                      # crossed below this share of the ratio its choice assumed: normal KV's
                      # groups stay within 2 % of their request's ratio (1.6 % per layer on every
                      # BF16 family and variant, the slot padding 0.5 % on 48 KiB tensors), the
                      # failure it catches is 23 % (wide BF16 through the speed mode: 1.30 -> 1.00)
BULK_SHARE = 0.25       # a request whose layers were all given within this share of its time was
                        # bound by the transfer, not its producer: its time calibrates codec="auto"


class SendHandle:
    """One request on its way: ``send_layer`` (streaming), ``wait``, ``cancel``, ``stats``."""

    def __init__(self, sender: "Sender", req: str, n_layers: int, codec_name: str, wire):
        self._sender, self.request, self.n_layers = sender, req, n_layers
        self.codec = codec_name           # the wire codec's name or "raw": for "auto", what was chosen
        self._auto = codec_name == "auto"
        self._wire = wire
        self.reason = ""                  # for "auto": why
        self._assumed = None              # for "auto": the ratio the choice assumed for self.codec
        self._rechosen = False            # for "auto": re-chosen already (at most once a request)
        self._encoded = 0                 # groups encoded (the pipeline's count)
        self._queued: set[int] = set()
        self._pending: list = []          # layers waiting to fill a group
        self._pending_bytes = 0
        self._group_bytes = None
        self._plan = None                 # (group sizes, tensors a group, speed_ceiling): what auto predicts for
        self._all_queued = None           # when the last layer was given
        self._groups_flushed = 0
        self._progress = 0                # accepted, groups encoded and written: what wait() watches
        self._accepted = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.stats = {"request": req, "codec": codec_name, "layers": n_layers, "groups": 0,
                      "tensors": 0, "raw_bytes": 0, "sent_bytes": 0, "encode_s": 0.0, "decode_s": 0.0,
                      "write_s": 0.0, "start": now(), "end": None, "timeline": [], "group_codecs": []}

    def _use(self, name: str) -> None:
        """codec="auto" chose ``name`` (one of codec.CHOICES) for the groups not yet encoded."""
        self.codec, self._wire = name, None if name == "raw" else codec.get(name)

    # -- caller side
    def send_layer(self, index: int, *tensors) -> None:
        """Queue layer ``index`` (one or more tensors, e.g. k and v).  The tensors must not be
        overwritten before the request completes (``wait``)."""
        if type(index) is not int or not 0 <= index < self.n_layers:
            raise ValueError(f"layer index {index!r} is outside the request's {self.n_layers} layers")
        if not tensors:
            raise ValueError("send_layer needs at least one tensor")
        with self._lock:
            if index in self._queued:
                raise ValueError(f"layer {index} of request {self.request!r} was sent already")
            self._queued.add(index)
            self._sender._add_layer(self, index, tensors)
            if len(self._queued) == self.n_layers:
                self._sender._flush(self, last=True)
                self._all_queued = now()  # after the flush: set, it says every group is queued

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the receiver has every layer decoded; returns the request's stats.
        Raises TransferError (or kvzip.FormatError from the receiver) if it failed, and
        TimeoutError after ``timeout`` seconds, or, with None, once a whole Sender timeout passes
        without this request being accepted or a group of it encoded or written (a stalled
        transfer; a long one on a slow link is not cut off)."""
        if timeout is not None:
            if not self._done.wait(timeout):
                raise TimeoutError(f"request {self.request!r} not done after {timeout} s")
        else:
            seen = -1
            while not self._done.wait(self._sender.timeout):
                if self._progress == seen:
                    raise TimeoutError(f"request {self.request!r} made no progress in {self._sender.timeout} s")
                seen = self._progress
        if self._error is not None:
            raise self._error
        return dict(self.stats)

    def cancel(self) -> None:
        self._sender._cancel(self)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # -- sender side
    def _finish(self, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self._error = error
            self.stats["end"] = now()
            self._done.set()
            self._accepted.set()


class Sender:
    """Sends requests' KV to one Receiver (its ``address``) through a transfer engine.

    codec: "kvzip" (the speed mode's default pipeline), "kvzip-ratio" (the ratio mode: a smaller
    wire, a slower codec), "raw", "auto" (whichever of the three is predicted to be fastest on
    this link, see codec.AutoChooser), a kvzip.Pipeline, or the name of a WireCodec registered
    (kvzip.transfer.register_codec) in both processes.
    link_gbps: emulate a link of that rate (benchmarks; pacing.py).  group_bytes: raw bytes per
    message (default: the request split in about 8, at least 8 MiB, at most a ring slot).
    timeout: seconds any one step may stall (connect, a credit, an acceptance) before failing.
    """

    def __init__(self, address: str, *, engine="mooncake", codec="kvzip", link_gbps: float | None = None,
                 group_bytes: int | None = None, timeout: float = 30.0):
        self.codec, self._wire = _wire_of(codec)
        if group_bytes is not None and (type(group_bytes) is not int or group_bytes <= 0):
            raise ValueError(f"group_bytes must be a positive int, got {group_bytes!r}")
        self.timeout = float(timeout)
        self._group_bytes = group_bytes
        self._pacer = Pacer(link_gbps) if link_gbps is not None else None
        self._link_gbps = link_gbps
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout)
        except OSError as e:
            raise TransferError(f"no kvzip receiver at {address}: {e}") from None
        self._chan = Channel(sock)
        try:
            hello = check_hello(self._chan.recv() or {})
        except (TransferError, OSError) as e:
            self._chan.close()
            raise TransferError(f"{address} did not greet as a kvzip receiver: {e}") from None
        sock.settimeout(None)
        if hello.get("refused"):
            self._chan.close()
            raise TransferError(f"receiver at {address} refused the connection: {hello['refused']}")
        try:
            self._engine = make_engine(engine)
        except BaseException:
            self._chan.close()
            raise
        if self._engine.name != hello["engine"]:
            self._engine.close()
            self._chan.close()
            raise TransferError(f"receiver at {address} uses engine {hello['engine']!r}, this sender {self._engine.name!r}")
        self.address, self._peer = address, hello["session"]
        ring = hello["ring"]
        self.slot_bytes, self._remote_base, self._slots = ring["slot_bytes"], ring["base"], ring["slots"]
        self._free_remote: queue.Queue = queue.Queue()
        for s in range(self._slots):
            self._free_remote.put(s)
        self._staging: Buffer | None = None
        self._free_staging: list[int] = []  # the pipeline's alone once staging is set
        self._device = None
        self._auto: AutoChooser | None = None
        self._handles: dict[str, SendHandle] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self._to_encode: queue.Queue = queue.Queue()
        # The pipeline's own state: the write in flight (at most one, so the link is one pipe as
        # the Pacer models it) and the landed writes' notices, in order, each due at its arrival.
        self._flight: tuple | None = None
        self._on_stream = False  # the pipeline thread's current CUDA stream is _stream
        self._notices: collections.deque = collections.deque()
        self._local = threading.local()
        self._threads = [threading.Thread(target=self._guard, args=(stage,), name=f"kvzip-tx-{stage.__name__}",
                                          daemon=True) for stage in (self._read, self._pipeline)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ public API
    def send(self, request: str, layers, codec=None) -> SendHandle:
        """Send a whole request: ``layers`` is a list of tensors or of tuples of tensors.
        Returns at once; ``handle.wait()`` blocks until the receiver has it all.
        codec: this request's codec (default: the Sender's)."""
        layers = list(layers)
        h = self.begin(request, len(layers), codec)
        try:
            for i, layer in enumerate(layers):
                h.send_layer(i, *(layer if isinstance(layer, (tuple, list)) else (layer,)))
        except BaseException:
            self._cancel(h)
            raise
        return h

    def begin(self, request: str, n_layers: int, codec=None) -> SendHandle:
        """Start a streamed request of ``n_layers`` layers; send them with ``send_layer``."""
        self._check_open()
        name, wire = (self.codec, self._wire) if codec is None else _wire_of(codec)
        if type(request) is not str or not 0 < len(request) <= 256:
            raise ValueError(f"request id must be a non-empty string of at most 256 characters, got {request!r}")
        if type(n_layers) is not int or not 0 < n_layers <= 1 << 20:
            raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
        h = SendHandle(self, request, n_layers, name, wire)
        with self._lock:
            if request in self._handles:
                raise ValueError(f"request {request!r} is already in flight on this sender")
            self._handles[request] = h
        self._chan.send("begin", req=request, n_layers=n_layers, codec=name)
        self._local.current = h
        return h

    def send_layer(self, index: int, *tensors, request: str | None = None) -> None:
        """``begin(...).send_layer`` for the request this thread began last (or ``request``)."""
        h = self._handles.get(request) if request is not None else getattr(self._local, "current", None)
        if h is None:
            raise ValueError("no request begun on this thread: call begin(request, n_layers) first")
        h.send_layer(index, *tensors)

    def set_link(self, gbps: float | None) -> None:
        """Emulate a link of ``gbps`` GB/s from the next message on (None: the engine's own
        speed).  codec="auto" starts its estimates for the new link afresh."""
        self._pacer = Pacer(gbps) if gbps is not None else None
        self._link_gbps = gbps
        if self._auto is not None:
            self._auto = AutoChooser(self._device, gbps)

    def cancel(self, request: str) -> None:
        h = self._handles.get(request)
        if h is not None:
            self._cancel(h)

    def close(self) -> None:
        """Fail what is still in flight, stop the threads, unregister memory.  Idempotent.
        Returns once the receiver has let this sender's ring window go, so the next Sender can
        connect at once, even to a receiver of max_senders=1."""
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            # Half-close: the receiver reads the end of the control stream, frees the window and
            # closes its side, which ends this sender's reader.
            try:
                self._chan.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._threads[0].join(timeout=self.timeout)  # the reader
        self._fail(TransferError("the sender was closed"))
        self._to_encode.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ grouping (caller's thread)
    def _add_layer(self, h: SendHandle, index: int, tensors) -> None:
        self._check_open()
        for t in tensors:
            buffers.framework(t)  # TypeError for anything but torch / NumPy
        need = codec.slot_need(tensors)
        if need > self.slot_bytes:
            raise ValueError(f"layer {index} needs {need} bytes, more than one slot of the receiver's ring "
                             f"({self.slot_bytes} bytes): give the Receiver a larger slot_bytes")
        if self._staging is None:
            with self._lock:  # the first layer of the first request; other threads may race it
                if self._staging is None:
                    self._start_staging(buffers.device_of(tensors[0]))
        for t in tensors:
            if buffers.device_of(t) != self._device:
                raise ValueError(f"this sender stages {self._device} memory; layer {index} has a tensor on {buffers.device_of(t)}")
        if h._group_bytes is None:
            total = need * h.n_layers
            h._group_bytes = self._group_size(total)
            n_groups = max(1, -(-total // h._group_bytes))
            calls = len(tensors) * max(1, min(h.n_layers, h._group_bytes // need))  # tensors a group
            # The plan's groups add up to the request, as the groups sent will: a request below
            # a group's size (MIN_GROUP) is predicted as itself, not as a full group, or every
            # codec's fixed costs would be weighed against a phantom request's bytes.
            # The first layer's formats stand for the request's, as its size does.
            h._plan = ([h._group_bytes] * (n_groups - 1) + [total - h._group_bytes * (n_groups - 1)], calls,
                       codec.speed_ceiling(tensors))
            if h._auto:
                pick, why = self._auto.choose(*h._plan)
                h._use(pick)
                h._assumed = self._auto.assumed(pick, h._plan[2])
                h.stats["codec"] = h.codec
                self._note(h, why)
        limit = min(FIRST_GROUP, h._group_bytes) if h._groups_flushed == 0 else h._group_bytes
        last = len(h._queued) == h.n_layers
        if h._pending and (h._pending_bytes + need > limit
                           or last and need >= FIRST_GROUP and h._pending_bytes >= 2 * need):
            self._flush(h, last=False)
        h._pending.append((index, tensors, _fence(tensors)))
        h._pending_bytes += need

    def _group_size(self, total: int) -> int:
        if self._group_bytes is not None:
            return min(self._group_bytes, self.slot_bytes)
        return min(self.slot_bytes, max(MIN_GROUP, -(-total // TARGET_GROUPS)))

    def _flush(self, h: SendHandle, last: bool) -> None:
        if h._pending:
            self._to_encode.put(("group", h, h._pending))
            h._pending, h._pending_bytes = [], 0
            h._groups_flushed += 1
        if last:
            self._to_encode.put(("end", h, None))

    def _start_staging(self, device: str) -> None:
        """Registered staging memory on the first tensor's device, and on an unpaced link its
        speed (_probe_link); ``_staging`` is set last, so a thread that sees it sees everything
        else too."""
        staging = Buffer(STAGING_SLOTS * self.slot_bytes, device)
        self._engine.register(staging.ptr, staging.nbytes, device)
        auto = AutoChooser(device, self._link_gbps)
        if self._link_gbps is None:
            try:
                self._probe_link(staging, auto)
            except BaseException:  # the peer is gone: no staging, nothing left registered
                self._engine.unregister(staging.ptr)
                raise
        self._device, self._auto = device, auto
        self._free_staging.extend(range(STAGING_SLOTS))
        if device != "cpu":
            import torch

            self._stream = torch.cuda.Stream(device=device)
        self._staging = staging

    def _probe_link(self, staging: Buffer, auto: AutoChooser) -> None:
        """The engine's own speed, before the first request needs it (codec="auto" chooses by it):
        PROBE_WRITES writes of PROBE_BYTES from the staging memory into a free slot of the
        receiver's ring, the last one timed (the first pays the engine's connection set-up).  The
        receiver reads a slot only when a message names it, so the bytes are never looked at."""
        nbytes = min(PROBE_BYTES, self.slot_bytes)
        remote = self._await(lambda t: _get(self._free_remote, t), "credit (a free slot in the receiver's ring)",
                             notices=False)  # the caller's thread, before the pipeline has any
        try:
            for k in range(PROBE_WRITES):
                timed = k == PROBE_WRITES - 1
                start = now()
                self._engine.write(self._peer, staging.ptr, self._remote_base + remote * self.slot_bytes, nbytes)
                if timed:
                    auto.observe_link(nbytes, now() - start)
        except EngineError as e:
            raise TransferError(f"writing to {self.address} failed: {e}") from None
        finally:
            self._free_remote.put(remote)

    # ------------------------------------------------------------------ threads
    def _guard(self, stage) -> None:
        """Run a thread's loop; any failure ends every request, loudly."""
        try:
            stage()
        except BaseException as e:  # noqa: BLE001
            if not self._closed:
                log.error("kvzip sender %s failed: %s", stage.__name__, e)
            self._fail(e if isinstance(e, TransferError) else TransferError(f"{type(e).__name__}: {e}"))

    def _pipeline(self) -> None:
        """Each group in order: encoded into a staging slot while the previous group's write is in
        flight, then that write landed, then this group's write started.  A request's "end" goes
        after its last write has landed, so it follows all of the request's data messages."""
        try:
            while True:
                item = self._next()
                if item is None or self._error is not None:
                    return
                kind, h, layers = item
                if kind == "end":
                    self._land()
                    self._notices.append((0.0, "end", h, None, None))
                    continue
                if h.done:  # cancelled or failed while queued
                    continue
                encoded = self._encode(h, layers)
                self._land()
                self._start_write(h, *encoded)
        finally:  # the staging memory is unregistered after this thread ends: no write may still read it
            if self._flight is not None:
                write = self._flight[1]
                deadline = now() + 5
                try:
                    while not write.wait(0.1) and now() < deadline:
                        pass
                except EngineError:
                    pass

    def _next(self):
        """The next queued group or end; until there is one, the write in flight lands and each
        notice goes out when it falls due."""
        while True:
            self._send_due()
            try:
                return self._to_encode.get_nowait()
            except queue.Empty:
                pass
            if self._flight is not None:
                self._land()
            elif self._notices:
                left = self._notices[0][0] - now()
                if left > 2e-4:  # a timed wait overshoots by up to ~100 us: wait_until takes the end
                    try:
                        return self._to_encode.get(timeout=left - 2e-4)
                    except queue.Empty:
                        pass
                else:
                    wait_until(self._notices[0][0])
            else:
                return self._to_encode.get()

    def _encode(self, h: SendHandle, layers) -> tuple:
        queued = now()
        slot = self._free_staging.pop()  # STAGING_SLOTS: one slot is free whenever a group is encoded
        tensors = [t for _, ts, _ in layers for t in ts]
        h.stats["tensors"] += len(tensors)
        if self._device != "cpu":
            import torch

            if not self._on_stream:  # this thread's current device and stream, once (the pipeline's)
                torch.cuda.set_device(self._stream.device)
                torch.cuda.set_stream(self._stream)
                self._on_stream = True
            for *_, fence in layers:
                if fence is not None:
                    self._stream.wait_event(fence)
        if h._auto and h._encoded == 0 and h.codec == "kvzip":
            self._estimate(h, tensors)
        h._encoded += 1
        name = h.codec  # the group's codec, whatever _recheck makes h.codec for later groups
        wire = None if name == "raw" else h._wire
        base = slot * self.slot_bytes
        t0 = now()
        if self._device == "cpu":
            blobs = codec.encode(wire, tensors)
            coded = now()
            entries, nbytes, total = codec.pack(self._staging, base, tensors, blobs, name)
            events = None
        else:  # torch: imported above, on this device
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record(self._stream)
            blobs = codec.encode(wire, tensors)
            coded = now()
            entries, nbytes, total = codec.pack(self._staging, base, tensors, blobs, name, self._stream)
            events[1].record(self._stream)
        packed = now()
        host_s = packed - t0
        marks = {"queued": queued, "slot": t0, "coded": coded, "packed": packed}
        h._progress += 1
        msg_layers, k = [], 0
        for index, ts, _ in layers:
            msg_layers.append({"index": index, "tuple": len(ts) > 1, "tensors": entries[k:k + len(ts)]})
            k += len(ts)
        raw = sum(buffers.nbytes(t) for t in tensors)
        return slot, nbytes, msg_layers, raw, events, host_s, total, marks, name

    def _start_write(self, h: SendHandle, slot, nbytes, layers, raw, events, encode_s, total, marks, name) -> None:
        if events is not None:  # the encode's span on its stream, if longer than its host time
            events[1].synchronize()
            encode_s = max(encode_s, events[0].elapsed_time(events[1]) / 1e3)
        marks["encoded"] = now()
        if h.done:  # cancelled or failed while it was encoded
            self._free_staging.append(slot)
            return
        self._await(lambda t: h._accepted.wait(t) or None,
                    f"acceptance of request {h.request!r} by the receiver")
        remote = self._await(lambda t: _get(self._free_remote, t), "credit (a free slot in the receiver's ring)")
        marks["credit"] = now()
        try:
            write = self._engine.write_async(self._peer, self._staging.ptr + slot * self.slot_bytes,
                                             self._remote_base + remote * self.slot_bytes, nbytes)
        except EngineError as e:
            raise TransferError(f"writing request {h.request!r} to {self.address} failed: {e}") from None
        self._flight = (h, write, slot, remote, nbytes, layers, raw, encode_s, total, marks, name)

    def _land(self) -> None:
        """Wait for the write in flight (sending notices as they fall due), account for it and
        queue its notice."""
        if self._flight is None:
            return
        h, write, slot, remote, nbytes, layers, raw, encode_s, total, marks, name = self._flight
        try:
            if write.wait(0):  # landed while the next group was encoded: its end is the engine's to say
                written, measured = (write.ended, True) if write.ended is not None else (now(), False)
            else:  # seen landing: now is its end
                self._await(lambda t: write.wait(t) or None, f"end of a write of request {h.request!r}")
                written, measured = now(), True
        except EngineError as e:
            self._flight = None  # over: nothing reads the staging slot any more
            raise TransferError(f"writing request {h.request!r} to {self.address} failed: {e}") from None
        self._flight = None
        self._free_staging.append(slot)
        start = marks["credit"]
        marks["written"] = written
        arrival = marks["arrival"] = self._pacer.arrival(nbytes, start, written) if self._pacer else written
        s = h.stats
        s["timeline"].append(marks)
        if self._pacer is None and measured:  # what the engine really moves, whatever the bytes are
            self._auto.observe_link(nbytes, written - start)
        h._progress += 1
        s["groups"] += 1
        s["raw_bytes"] += raw
        s["sent_bytes"] += nbytes
        s["encode_s"] += encode_s
        s["write_s"] += written - start
        s["group_codecs"].append(name)
        s["codec"] = name  # what the request's groups went as, the last one's once it changed
        if h._auto:
            self._recheck(h, name, raw, nbytes)
        digest = f"{sum64_finish(total, nbytes):016x}"  # ready: the encode's stream is synchronised
        self._notices.append((arrival, "data", h, {"req": h.request, "slot": remote, "nbytes": nbytes,
                                                   "digest": digest, "layers": layers}, marks))

    def _estimate(self, h: SendHandle, tensors) -> None:
        """codec="auto" chose the speed mode for ``h`` from the connection's estimates: before its
        first group is encoded, its own tensors' exponents (codec.speed_estimate, on the group's
        tensors) are asked what the speed mode makes of them, and where that is below
        RECHECK_BELOW of what the choice assumed the request is chosen for again with it.  So KV
        of a wide exponent range goes as the ratio mode from its first group, not only after one
        has crossed at 1.0x (_recheck, which still follows).  Costs a sampled histogram a tensor
        and a wait for the first group's tensors, once a request."""
        estimate = codec.speed_estimate(tensors)
        if estimate >= RECHECK_BELOW * h._assumed:
            return
        sizes, calls, ceiling = h._plan
        pick, why = self._auto.choose(sizes, calls, ceiling, {"kvzip": estimate})
        note = f"; its tensors' exponents predict kvzip at {estimate:.3f}x, {h._assumed:.3f}x assumed: sending {pick} ({why})"
        h._use(pick)
        h._assumed = estimate if pick == "kvzip" else self._auto.assumed(pick, ceiling)
        h.stats["codec"] = pick
        self._note(h, note)

    def _recheck(self, h: SendHandle, name: str, raw: int, sent: int) -> None:
        """codec="auto", a group of ``h`` landed: where it crossed with the codec chosen for it at
        a ratio below RECHECK_BELOW of what the choice assumed, the connection's estimate takes
        the measurement and the request's groups not yet encoded are chosen for again, with that
        ratio for that codec (this request's own data).  Invariants: a request is re-chosen at
        most once, so it changes codec at most once; a group keeps the codec it was encoded with
        (every TensorEntry names its own, so the receiver needs nothing new)."""
        ratio = raw / max(sent, 1)
        if h._rechosen or name != h.codec or name == "raw" or ratio >= RECHECK_BELOW * h._assumed:
            return
        h._rechosen = True
        self._auto.observe_group(name, raw, sent)
        note = f"; after group {len(h.stats['group_codecs'])}: {name} measured {ratio:.3f}x, {h._assumed:.3f}x assumed"
        if h._all_queued is not None and h._encoded == h._groups_flushed:
            note += ", no group left to send otherwise"
        else:
            sizes, calls, ceiling = h._plan  # the plan's groups not yet encoded (its last, if it ran short)
            pick, why = self._auto.choose(sizes[h._encoded:] or sizes[-1:], calls, ceiling, {name: ratio})
            note += f", sending {pick} from group {h._encoded + 1} ({why})" if pick != name else f", keeping {name} ({why})"
            h._use(pick)
        self._note(h, note)

    @staticmethod
    def _note(h: SendHandle, note: str) -> None:
        """codec="auto"'s reasons for request ``h``, one more: in stats["auto"] and the log."""
        h.reason += note
        h.stats["auto"] = h.reason
        log.info("request %s: codec=auto sends %s: %s", h.request, h.codec, note.removeprefix("; "))

    def _send_due(self) -> None:
        """Send the notices whose arrival has come, in order."""
        while self._notices and self._notices[0][0] <= now():
            _, kind, h, msg, marks = self._notices.popleft()
            if kind == "end":
                self._chan.send("end", req=h.request, layers=h.n_layers)
            elif not h.done:
                marks["notified"] = now()
                self._chan.send("data", **msg)
            else:  # the receiver will not read it: the slot is free again
                self._free_remote.put(msg["slot"])

    def _await(self, ready, what: str, notices: bool = True):
        """``ready(seconds)``'s first non-None answer, asked in steps.  With ``notices`` (the
        pipeline thread, whose own they are) the steps end when the next notice falls due, which
        is sent meanwhile: a held-back notice would hold back the credits this thread may be
        waiting for.  TransferError if the Sender fails or ``timeout`` passes."""
        deadline = now() + self.timeout
        while True:
            if self._error is not None:
                raise self._error
            if notices:
                self._send_due()
            t = now()
            step = min(0.1, deadline - t)
            if notices and self._notices:
                step = min(step, self._notices[0][0] - t)
            got = ready(max(step, 0.0))
            if got is not None:
                return got
            if now() > deadline:
                raise TransferError(f"no {what} within {self.timeout} s: the receiver is stalled")

    def _read(self) -> None:
        while True:
            msg = self._chan.recv()
            if msg is None:
                raise TransferError(f"receiver at {self.address} closed the connection")
            kind = msg["kind"]
            if kind == "credit":
                slot = msg.get("slot")
                if type(slot) is not int or not 0 <= slot < self._slots:
                    raise ProtocolError(f"credit for slot {slot!r} outside the ring")
                self._free_remote.put(slot)
                continue
            h = self._handles.get(msg.get("req"))
            if h is None:
                continue  # a verdict on a request this sender already gave up
            if kind == "accept":
                h._progress += 1
                h._accepted.set()
            elif kind == "reject":
                self._end(h, TransferError(f"receiver rejected request {h.request!r}: {msg.get('why')}"))
            elif kind == "done":
                h.stats["decode_s"] = float(msg.get("decode_s", 0.0))
                h.stats["receiver_timeline"] = msg.get("timeline") if isinstance(msg.get("timeline"), list) else []
                s = h.stats
                # A request whose groups went in two codecs is no one codec's measure (the group
                # that changed it was observed already, AutoChooser.observe_group).
                if s["codec"] in codec.CHOICES and self._auto is not None and len(set(s["group_codecs"])) == 1:
                    took = now() - s["start"]
                    bulk = h._all_queued is not None and h._all_queued - s["start"] <= BULK_SHARE * took
                    self._auto.observe(s["codec"], s["raw_bytes"], s["sent_bytes"], s["groups"], s["encode_s"], s["decode_s"],
                                       s["tensors"], took if bulk else None, h._plan)
                self._end(h, None)
            elif kind == "failed":
                self._end(h, _remote_error(msg, h.request))
            else:
                raise ProtocolError(f"unexpected {kind!r} message from the receiver")

    # ------------------------------------------------------------------ helpers
    def _end(self, h: SendHandle, error) -> None:
        with self._lock:
            self._handles.pop(h.request, None)
        h._finish(error)

    def _cancel(self, h: SendHandle) -> None:
        if h.done:
            return
        self._end(h, TransferError(f"request {h.request!r} was cancelled"))
        try:
            self._chan.send("cancel", req=h.request)
        except TransferError:
            pass

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            handles, self._handles = list(self._handles.values()), {}
        for h in handles:
            h._finish(error)
        self._chan.close()

    def _check_open(self) -> None:
        if self._error is not None:
            raise TransferError(f"this sender has failed or was closed: {self._error}")


def _fence(tensors):
    """An event on the caller's current CUDA stream after which the tensors are ready."""
    t = tensors[0]
    if buffers.framework(t) != "torch" or not t.is_cuda:
        return None
    import torch

    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


def _remote_error(msg: dict, req: str) -> BaseException:
    why = f"receiver failed request {req!r}: {msg.get('why')}"
    if msg.get("error") == "FormatError":
        from ..errors import FormatError

        return FormatError(why)
    return TransferError(why)


def _wire_of(c) -> tuple[str, codec.WireCodec | None]:
    """(the codec setting's name, the WireCodec behind it; None for raw)."""
    if isinstance(c, Pipeline):
        return "kvzip", codec.KvzipWire(c)
    if c == "raw":
        return "raw", None
    if c == "auto":
        return "auto", codec.get("kvzip")
    if isinstance(c, str) and c in codec.known():
        return c, codec.get(c)
    raise ValueError(f"codec must be 'kvzip', 'raw', 'auto', a kvzip.Pipeline or a registered wire codec "
                     f"({sorted(codec.known())}), got {c!r}")


def _get(q: queue.Queue, timeout: float):
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None
