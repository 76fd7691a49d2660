"""Pipeline: an ordered list of stages, checked once at construction, run on CPU or GPU.

A chain is valid when each stage accepts what the one before gives (the kinds in
stages/base.py), it starts from a tensor and ends with Serialize.  When ExponentSplit,
Top16Pack and EscapeStream follow each other, they run as one fused pass
(stages/fused.py); ``last_path`` says which path the last call took.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from .container import FLAG_STORED
from .errors import FormatError
from .frame import Frame
from .gpu import programs, quantize_kernels


_stages = None


def _stages_module():
    # Imported lazily (the stage package imports kvzip submodules itself), once.
    global _stages
    if _stages is None:
        from . import stages

        _stages = stages
    return _stages


class Pipeline:
    def __init__(self, stages: Iterable, *, fuse: bool = True):
        st = _stages_module()
        self.stages = list(stages)
        self.fuse = fuse
        self.last_path: str | None = None
        self._encode_lanes: dict = {}  # (format, shape) -> programs.EncodeLane
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage (Serialize)")
        for s in self.stages:
            if not isinstance(s, st.Stage):
                raise TypeError(f"pipeline entries must be kvzip stages, got {type(s).__name__}")
        kind = st.base.TENSOR
        for i, s in enumerate(self.stages):
            if kind not in s.input_kind:
                prev = type(self.stages[i - 1]).__name__ if i else "the input tensor"
                raise ValueError(
                    f"{type(s).__name__} (stage {i}) takes {'/'.join(s.input_kind)} but {prev} gives {kind}"
                )
            kind = s.output_kind
        if kind != st.base.BYTES:
            raise ValueError(f"a pipeline must end with Serialize; it ends with {type(self.stages[-1]).__name__}")

    # --------------------------------------------------------------- config
    def to_config(self) -> dict[str, Any]:
        return {"stages": [s.get_config() for s in self.stages]}

    @classmethod
    def from_config(cls, config) -> "Pipeline":
        """From to_config()'s dict, its JSON text, or a plain list of stage configs."""
        if isinstance(config, (str, bytes)):
            config = json.loads(config)
        if isinstance(config, dict):
            config = config.get("stages")
        if not isinstance(config, list):
            raise ValueError("a pipeline config is {'stages': [...]}, its JSON, or a list of stage configs")
        st = _stages_module()
        return cls([st.stage_from_config(c) for c in config])

    def _stage_configs(self) -> list:
        """to_config()["stages"], built once: blobs record it, and the fast path caches its plans
        by it.  (Stages are configured at construction and not changed afterwards.)"""
        if getattr(self, "_configs", None) is None:
            self._configs = self.to_config()["stages"]
        return self._configs

    def to_json(self) -> str:
        return json.dumps(self.to_config())

    def blob_streams(self) -> set[str]:
        """The exact set of streams a blob of this pipeline holds."""
        names = {"data"}
        for s in self.stages:
            names = (names - set(s.consumes)) | set(s.produces)
        return names

    @property
    def lossless(self) -> bool:
        return all(s.lossless for s in self.stages)

    def __eq__(self, other):
        return isinstance(other, Pipeline) and self.to_config() == other.to_config()

    def __repr__(self):
        return "Pipeline([" + ", ".join(map(repr, self.stages)) + "])"

    # --------------------------------------------------------------- running
    def _steps(self, stages):
        """Stages with each ExponentSplit, Top16Pack, EscapeStream run replaced by a fused step."""
        st = _stages_module()
        steps, i = [], 0
        while i < len(stages):
            trio = [type(s) for s in stages[i:i + 3]]
            if self.fuse and trio == [st.ExponentSplit, st.Top16Pack, st.EscapeStream]:
                steps.append(st.FusedSplitPackEscape(stages[i + 1], stages[i + 2]))
                i += 3
            else:
                steps.append(stages[i])
                i += 1
        return steps

    def encode_frame(self, frame: Frame) -> Frame:
        """Tensor frame -> blob frame.  Falls back to storing the values raw (flagged) when the
        split/pack/escape streams would be larger than the values themselves."""
        st = _stages_module()
        body, serialize = self.stages[:-1], self.stages[-1]
        frame.meta["pipeline"] = self._stage_configs()
        steps = self._steps(body)
        self.last_path = "staged"
        before_split = None
        for i, step in enumerate(steps):
            if isinstance(step, (st.ExponentSplit, st.FusedSplitPackEscape)):
                before_split = frame
            if isinstance(step, st.FusedSplitPackEscape):
                self.last_path = "fused"
                if i == len(steps) - 1 and programs.applicable(frame.backend, frame.n, frame.streams.get("data")):
                    # On a GPU the last fused step writes the container itself: no stream copies.
                    batch = programs.encode_batch([frame], step.top16, step.chunk, serialize.checksum)
                    if batch.fits[0]:
                        self.last_path = "fast"
                        self._remember_lane(frame, batch.plans[0], steps, serialize.checksum)
                        return Frame(frame.backend, {"blob": batch.blob(0)}, frame.meta)
                    return self._stored(before_split)
                if i == len(steps) - 1 and frame.backend.name == "cpu" and set(frame.streams) == {"data"}:
                    # The CPU writes the container itself too; a frame with more streams (a
                    # quantizer's scales) takes the general way below.
                    out = step.encode_blob(frame, serialize.checksum)
                    return self._stored(before_split) if out is None else out
            frame = step.encode(frame)
        if before_split is not None and serialize.payload_size(frame) > serialize.payload_size(before_split):
            return self._stored(before_split)
        return serialize.encode(frame)

    def _lane(self, fmt, shape: tuple, backend, bits):
        """The lane for tensors of this format and shape, if there is one and bits (the input,
        on backend) can take it; else None."""
        lane = self._encode_lanes.get((fmt.name, shape)) if self.fuse else None
        if lane is None or not programs.applicable(backend, 0, bits):
            return None
        return lane

    def _remember_lane(self, frame: Frame, plan, steps: list, checksum: bool) -> None:
        """Keep what the fast path worked out for tensors of this format and shape (api.encode_with
        sends the next one straight to it) when the program can do the whole body: the fused
        step alone, or after QuantizeFP8 with one scale per tensor of 16-bit input (the program
        then quantizes too).  frame: the fused step's input.  Stages are not changed after
        construction, so a lane stays valid for this pipeline."""
        st = _stages_module()
        quantize = None
        if checksum or len(steps) > 2:
            return
        if len(steps) == 2:
            front = steps[0]
            if not (isinstance(front, st.QuantizeFP8) and front.granularity == "tensor"):
                return
            quantize = frame.meta["quantize_fp8"]["source_format"]
            if quantize not in quantize_kernels.SOURCES:
                return
        if len(self._encode_lanes) > 256:
            self._encode_lanes.clear()
        fmt, step = frame.format, steps[-1]
        self._encode_lanes[(quantize or fmt.name, tuple(frame.meta["shape"]))] = programs.EncodeLane(
            plan, fmt, step.top16.codebook_for(fmt), step.chunk, quantize)

    def _stored(self, before_split: Frame) -> Frame:
        """The values raw (after any stages ahead of the split), flagged as a size fallback."""
        st = _stages_module()
        split_at = next(i for i, s in enumerate(self.stages) if isinstance(s, st.ExponentSplit))
        serialize = self.stages[-1]
        stored = self.stages[:split_at] + [serialize]
        before_split.meta["pipeline"] = [s.get_config() for s in stored]
        self.last_path = "stored"
        return serialize.encode(before_split, flags=FLAG_STORED)

    def decode_frame(self, frame: Frame) -> Frame:
        """Blob frame -> tensor frame, following the pipeline recorded in the blob."""
        return self.decode_opened(_stages_module().Serialize().decode(frame))

    def decode_opened(self, frame: Frame) -> Frame:
        """decode_frame for a blob already opened (stages.serialize.open_blob)."""
        recorded = recorded_pipeline(frame.meta)
        recorded.fuse = self.fuse
        recorded.check_streams(frame)
        frame = recorded.decode_frame_steps(frame)
        self.last_path = recorded.last_path
        if set(frame.streams) != {"data"}:
            raise FormatError(f"decoding left streams {sorted(frame.streams)}; the blob holds unknown streams")
        return frame

    def check_streams(self, frame: Frame) -> None:
        """A blob must hold exactly the streams its pipeline writes: a stray one (say a 'data'
        beside the split streams) would otherwise be silently overwritten while decoding."""
        want = self.blob_streams()
        if set(frame.streams) != want:
            raise FormatError(f"blob holds streams {sorted(frame.streams)}; its pipeline writes {sorted(want)}")

    def decode_frame_steps(self, frame: Frame) -> Frame:
        """Undo this pipeline's stages (all but Serialize) on an opened blob's frame."""
        st = _stages_module()
        self.last_path = "staged"
        for step in reversed(self._steps(self.stages[:-1])):
            frame = step.decode(frame)
            if isinstance(step, st.FusedSplitPackEscape):
                self.last_path = "fast" if step.ran == "fast" else "fused"
        return frame

    def encode(self, x, *, dtype=None, backend: str | None = None):
        """Compress a tensor (torch / CuPy / NumPy / JAX, CPU or GPU) into a 1-D uint8 blob of
        the caller's framework on the caller's device."""
        return _api().encode_with(self, x, dtype=dtype, backend=backend)

    def encode_many(self, xs, *, dtype=None, backend: str | None = None) -> list:
        """Compress a list of tensors.  On a GPU the split/pack/escape work of all of them runs in
        one set of kernel launches (per float format) with one host synchronisation."""
        return _api().encode_many_with(self, xs, dtype=dtype, backend=backend)

    def decode_many(self, blobs, *, backend: str | None = None) -> list:
        """Decode a list of blobs; on a GPU with one header read-back and one decode launch per
        (format, chunk size) group."""
        return _api().decode_many_with(self, blobs, backend=backend)

    def decode(self, blob, *, backend: str | None = None):
        """Decode a blob made by any kvzip pipeline; returns the caller's framework."""
        return _api().decode_with(self, blob, backend=backend)


_api_module = None


def _api():
    """kvzip.api, which imports this module: imported on first use, then held (a from-import in
    each call cost ~0.3 us of every Pipeline.encode / decode)."""
    global _api_module
    if _api_module is None:
        from . import api

        _api_module = api
    return _api_module


_recorded: dict = {}
_recorded_by_id: dict = {}
MAX_CACHED_CONFIG = 4096  # longest config repr the two caches above hold (so at most ~2 MiB of keys)


def recorded_pipeline(meta: dict) -> Pipeline:
    """The pipeline a blob's metadata records (FormatError if it is not a valid one).  The stage
    objects are cached by the config's text: a serving loop decodes the same few pipelines."""
    config = meta.get("pipeline")
    # Parsed headers are cached (container.parse_header), so a serving loop hands in the same
    # config object call after call: look it up by identity before paying for its repr.
    hit = _recorded_by_id.get(id(config))
    if hit is not None and hit[0] is config:
        return Pipeline(hit[1])
    if not isinstance(config, list):  # docs/format.md, rule 17 (from_config also takes a dict)
        raise FormatError(f"bad pipeline in metadata: a list of stage configs is required, got {type(config).__name__}")
    key = repr(config)  # repr, not ==: 14.0 == 14 and False == 0, which the stages refuse
    stages = _recorded.get(key)
    if stages is None:
        try:
            stages = Pipeline.from_config(config).stages
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise FormatError(f"bad pipeline in metadata: {str(e)[:300]}") from None
        if len(key) > MAX_CACHED_CONFIG:  # a writer's config is a few hundred bytes: bound the caches' bytes
            return Pipeline(stages)
        if len(_recorded) > 256:
            _recorded.clear()
        _recorded[key] = stages
    if len(_recorded_by_id) > 256:
        _recorded_by_id.clear()
    _recorded_by_id[id(config)] = (config, stages)  # holding config keeps its id unique
    return Pipeline(stages)
