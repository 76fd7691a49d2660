"""The Stage contract and the registry that maps config ids to stage classes."""
from __future__ import annotations

from typing import Any, ClassVar

from kvzip.frame import Frame

# What a stage takes and gives.  The pipeline checks the chain once, at construction.
TENSOR = "tensor"    # stream "data": one value's bits per element
SPLIT = "split"      # streams "exponent" (uint8 per element) and "rest" (sign+mantissa per element)
PACKED = "packed"    # "codes" + packed "rest", exponents outside the codebook still pending
ESCAPED = "escaped"  # PACKED plus the escape streams: everything needed to rebuild the values
CHANNEL_CODED = "channel_coded"  # ChannelPack's streams: everything needed to rebuild the values
BYTES = "bytes"      # one uint8 blob

REGISTRY: dict[str, type["Stage"]] = {}


def register(cls):
    """Class decorator: make a stage constructible from its config id."""
    if cls.id in REGISTRY:
        raise ValueError(f"stage id {cls.id!r} registered twice")
    REGISTRY[cls.id] = cls
    return cls


class Stage:
    """One step of a pipeline.  Subclasses set the class variables and implement encode/decode.

    ``encode`` and ``decode`` take and return a Frame; they run on whatever backend the frame's
    arrays live on.  ``decode`` must validate every size it reads before a kernel touches memory
    and raise kvzip.FormatError when something is off.
    """

    id: ClassVar[str]
    input_kind: ClassVar[tuple[str, ...]]
    output_kind: ClassVar[str]
    lossless: ClassVar[bool] = True
    # Stream names this stage's encode removes and adds; the pipeline derives from them the exact
    # set of streams a blob must hold, and a decoder rejects any other set.
    consumes: ClassVar[tuple[str, ...]] = ()
    produces: ClassVar[tuple[str, ...]] = ()

    def encode(self, frame: Frame) -> Frame:
        raise NotImplementedError

    def decode(self, frame: Frame) -> Frame:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        """JSON-able parameters, with ``id``; ``from_config(get_config())`` rebuilds the stage."""
        return {"id": self.id}

    def recorded_config(self) -> dict[str, Any]:
        """What a blob records of this stage: the parameters its decoder needs (by default all of
        them; a stage whose blobs carry an encoder-only choice leaves that out)."""
        return self.get_config()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Stage":
        params = {k: v for k, v in config.items() if k != "id"}
        try:
            return cls(**params)
        except TypeError as e:
            raise ValueError(f"bad config for stage {cls.id!r}: {e}") from None

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __repr__(self):
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({params})"


def on_device(backend) -> bool:
    """Whether a stage with CUDA kernels of its own (ChannelPack, ChannelRans: kvzip/gpu/) runs
    them: CuPy arrays on a real GPU.  The Numba simulator's CUDA backend holds NumPy arrays, so
    there the stage runs its CPU kernels."""
    return backend.name == "cuda" and not backend.simulated


def stage_from_config(config: dict[str, Any]) -> Stage:
    if not isinstance(config, dict) or "id" not in config:
        raise ValueError(f"a stage config is a dict with an 'id', got {config!r}")
    try:
        cls = REGISTRY[config["id"]]
    except KeyError:
        raise ValueError(f"unknown stage id {config['id']!r}; known: {sorted(REGISTRY)}") from None
    return cls.from_config(config)
