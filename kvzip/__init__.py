"""kvzip: lossless compression of LLM tensors at GPU memory speed.

    blob = kvzip.compress(kv)          # torch / CuPy / NumPy / JAX, CPU or GPU
    back = kvzip.decompress(blob)      # same framework, device, dtype, shape and bits
"""
from .errors import FormatError  # noqa: F401
from .formats import FORMATS, FloatFormat, get_format  # noqa: F401
from .codebook import Codebook  # noqa: F401
from .calibrate import calibrate  # noqa: F401
from .pipeline import Pipeline  # noqa: F401
from .api import compress, compress_many, decompress, decompress_many, info, splitzip_pipeline  # noqa: F401
from . import stages  # noqa: F401  (kvzip.stages: the stage classes)

__version__ = "0.1.0"
__all__ = ["compress", "decompress", "compress_many", "decompress_many", "info", "calibrate", "Codebook", "Pipeline", "FormatError", "stages",
           "splitzip_pipeline", "FloatFormat", "get_format", "FORMATS"]
