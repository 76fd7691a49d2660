"""Pipeline: an ordered list of stages, checked once at construction; immutable configuration.

A chain is valid when each stage accepts what the one before gives (the kinds in
stages/base.py), it starts from a tensor and ends with Serialize.  A pipeline runs nothing
itself: encode/decode (and their _many forms) hand the work to an executor chosen in
kvzip/execution.py; kvzip.trace.last_path() says which path the calling thread's last call took.
When ExponentSplit, Top16Pack and EscapeStream follow each other (and ``fuse`` is on), they run as
one fused step (stages/fused.py) and the fused GPU executor can take the pipeline.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from . import execution
from .errors import FormatError
from .stages import BYTES, TENSOR, EscapeStream, ExponentSplit, FusedSplitPackEscape, Stage, Top16Pack, \
    stage_from_config


class Pipeline:
    """stages: the chain (ending with Serialize).  fuse: run ExponentSplit, Top16Pack,
    EscapeStream as one fused step (same bytes; False runs them one by one, the reference)."""

    __slots__ = ("_stages", "_fuse", "_configs", "_recorded", "_body_steps", "_key")

    def __init__(self, stages: Iterable, *, fuse: bool = True):
        stages = tuple(stages)
        if not stages:
            raise ValueError("a pipeline needs at least one stage (Serialize)")
        for s in stages:
            if not isinstance(s, Stage):
                raise TypeError(f"pipeline entries must be kvzip stages, got {type(s).__name__}")
        kind = TENSOR
        for i, s in enumerate(stages):
            if kind not in s.input_kind:
                prev = type(stages[i - 1]).__name__ if i else "the input tensor"
                raise ValueError(
                    f"{type(s).__name__} (stage {i}) takes {'/'.join(s.input_kind)} but {prev} gives {kind}"
                )
            kind = s.output_kind
        if kind != BYTES:
            raise ValueError(f"a pipeline must end with Serialize; it ends with {type(stages[-1]).__name__}")
        if type(fuse) is not bool:
            raise TypeError(f"fuse must be True or False, got {fuse!r}")
        # Stages are configured at construction and not changed afterwards, so all of this holds.
        object.__setattr__(self, "_stages", stages)
        object.__setattr__(self, "_fuse", fuse)
        object.__setattr__(self, "_configs", [st.get_config() for st in stages])
        object.__setattr__(self, "_recorded", [st.recorded_config() for st in stages])
        object.__setattr__(self, "_body_steps", _fused_steps(stages[:-1]) if fuse else stages[:-1])
        # What executors cache by: equal keys, equal pipelines (repr, not ==: 14.0 == 14 and
        # False == 0, which the stages refuse).
        object.__setattr__(self, "_key", (repr(self._configs), fuse))

    def __setattr__(self, name, value):
        raise AttributeError("a Pipeline is immutable: build a new one")

    @property
    def stages(self) -> tuple:
        return self._stages

    @property
    def fuse(self) -> bool:
        return self._fuse

    @property
    def body_steps(self) -> tuple:
        """The stages before Serialize, each ExponentSplit, Top16Pack, EscapeStream run replaced by
        one FusedSplitPackEscape step when the pipeline fuses."""
        return self._body_steps

    @property
    def stage_configs(self) -> list:
        """What blobs record of the stages (each one's recorded_config: to_config()["stages"] less
        encoder-only choices), built once (callers must not change it)."""
        return self._recorded

    @property
    def key(self) -> tuple:
        """A hashable key equal for pipelines of equal configuration (executors cache by it)."""
        return self._key

    # --------------------------------------------------------------- config
    def to_config(self) -> dict[str, Any]:
        return {"stages": [s.get_config() for s in self._stages]}

    @classmethod
    def from_config(cls, config, *, fuse: bool = True) -> "Pipeline":
        """From to_config()'s dict, its JSON text, or a plain list of stage configs."""
        if isinstance(config, (str, bytes)):
            config = json.loads(config)
        if isinstance(config, dict):
            config = config.get("stages")
        if not isinstance(config, list):
            raise ValueError("a pipeline config is {'stages': [...]}, its JSON, or a list of stage configs")
        return cls([stage_from_config(c) for c in config], fuse=fuse)

    @classmethod
    def recorded(cls, meta: dict, *, fuse: bool = True) -> "Pipeline":
        """The pipeline a blob's metadata records (FormatError if it is not a valid one)."""
        return recorded_pipeline(meta, fuse=fuse)

    def to_json(self) -> str:
        return json.dumps(self.to_config())

    def blob_streams(self) -> set[str]:
        """The exact set of streams a blob of this pipeline holds."""
        names = {"data"}
        for s in self._stages:
            names = (names - set(s.consumes)) | set(s.produces)
        return names

    def check_streams(self, frame) -> None:
        """A blob must hold exactly the streams its pipeline writes: a stray one (say a 'data'
        beside the split streams) would otherwise be silently overwritten while decoding."""
        want = self.blob_streams()
        if set(frame.streams) != want:
            raise FormatError(f"blob holds streams {sorted(frame.streams)}; its pipeline writes {sorted(want)}")

    @property
    def lossless(self) -> bool:
        return all(s.lossless for s in self._stages)

    def __eq__(self, other):
        return isinstance(other, Pipeline) and self.to_config() == other.to_config()

    def __hash__(self):
        return hash(self._key[0])

    def __repr__(self):
        return "Pipeline([" + ", ".join(map(repr, self._stages)) + "])"

    # --------------------------------------------------------------- running
    def encode(self, x, *, dtype=None, backend: str | None = None):
        """Compress a tensor (torch / CuPy / NumPy / JAX, CPU or GPU) into a 1-D uint8 blob of
        the caller's framework on the caller's device."""
        return execution.encode(self, x, dtype=dtype, backend=backend)

    def encode_many(self, xs, *, dtype=None, backend: str | None = None) -> list:
        """Compress a list of tensors.  On a GPU the split/pack/escape work of all of them runs in
        one set of kernel launches (per float format) with one host synchronisation."""
        return execution.encode_many(self, xs, dtype=dtype, backend=backend)

    def decode(self, blob, *, backend: str | None = None):
        """Decode a blob made by any kvzip pipeline; returns the caller's framework."""
        return execution.decode(self, blob, backend=backend)

    def decode_many(self, blobs, *, backend: str | None = None) -> list:
        """Decode a list of blobs; on a GPU with one header read-back and one decode launch per
        (format, chunk size) group."""
        return execution.decode_many(self, blobs, backend=backend)


def _fused_steps(stages) -> tuple:
    steps, i = [], 0
    while i < len(stages):
        if [type(s) for s in stages[i:i + 3]] == [ExponentSplit, Top16Pack, EscapeStream]:
            steps.append(FusedSplitPackEscape(stages[i + 1], stages[i + 2]))
            i += 3
        else:
            steps.append(stages[i])
            i += 1
    return tuple(steps)


_recorded: dict = {}        # (config repr, fuse) -> Pipeline
_recorded_by_id: dict = {}  # (id of a config object, fuse) -> (that object, Pipeline)
MAX_CACHED_CONFIG = 4096  # longest config repr the two caches above hold (so at most ~2 MiB of keys)


def recorded_pipeline(meta: dict, *, fuse: bool = True) -> Pipeline:
    """The pipeline a blob's metadata records (FormatError if it is not a valid one).  Pipelines
    are immutable, so they are cached by the config's text: a serving loop decodes the same few."""
    config = meta.get("pipeline")
    # Parsed headers are cached (container.parse_header), so a serving loop hands in the same
    # config object call after call: look it up by identity before paying for its repr.
    hit = _recorded_by_id.get((id(config), fuse))
    if hit is not None and hit[0] is config:
        return hit[1]
    if not isinstance(config, list):  # docs/format.md, rule 17 (from_config also takes a dict)
        raise FormatError(f"bad pipeline in metadata: a list of stage configs is required, got {type(config).__name__}")
    key = (repr(config), fuse)  # repr, not ==: 14.0 == 14 and False == 0, which the stages refuse
    pipe = _recorded.get(key)
    if pipe is None:
        try:
            pipe = Pipeline.from_config(config, fuse=fuse)
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise FormatError(f"bad pipeline in metadata: {str(e)[:300]}") from None
        if len(key[0]) > MAX_CACHED_CONFIG:  # a writer's config is a few hundred bytes: bound the caches' bytes
            return pipe
        if len(_recorded) > 256:
            _recorded.clear()
        _recorded[key] = pipe
    if len(_recorded_by_id) > 256:
        _recorded_by_id.clear()
    _recorded_by_id[(id(config), fuse)] = (config, pipe)  # holding config keeps its id unique
    return pipe
