"""Pipeline stages, one module each: the stage class, its kernels and its CPU twin."""
from .base import BYTES, REGISTRY, TENSOR, Stage, register, stage_from_config  # noqa: F401
from .quantize_fp8 import QuantizeFP8  # noqa: F401,E402
from .exponent_split import ExponentSplit  # noqa: F401,E402
from .top16_pack import Top16Pack  # noqa: F401,E402
from .escape_stream import EscapeStream  # noqa: F401,E402
from .channel_pack import ChannelPack  # noqa: F401,E402
from .channel_rans import ChannelRans  # noqa: F401,E402
from .serialize import Serialize  # noqa: F401,E402
from .fused import FusedSplitPackEscape  # noqa: F401,E402
