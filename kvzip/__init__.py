"""kvzip: lossless compression of LLM tensors at GPU memory speed.

    blob = kvzip.compress(kv)          # torch / CuPy / NumPy / JAX, CPU or GPU
    back = kvzip.decompress(blob)      # same framework, device, dtype, shape and bits
"""
import importlib.util as _util
import os as _os
import sys as _sys


def _source_tree_subpackages() -> None:
    """In a source checkout that is not installed (python run from the clone root), take the
    top-level stages/ and codebooks/ as kvzip.stages and kvzip.codebooks, as pyproject.toml's
    package-dir maps them for an install.  A checkout's own folders win over an editable install
    of another checkout (a git worktree run with PYTHONPATH pointing at it): kvzip/ and stages/
    must come from one tree, or a new stage would be missing from its own package.  A regular
    install has no top-level stages/ beside kvzip/ and is found as usual."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    for name in ("stages", "codebooks"):
        full, init = f"{__name__}.{name}", _os.path.join(root, name, "__init__.py")
        if full in _sys.modules or not _os.path.isfile(init):
            continue
        spec = _util.spec_from_file_location(full, init, submodule_search_locations=[_os.path.dirname(init)])
        module = _util.module_from_spec(spec)
        _sys.modules[full] = module
        spec.loader.exec_module(module)


_source_tree_subpackages()  # before the imports below, which reach kvzip.stages

from .errors import FormatError  # noqa: F401,E402
from .formats import FORMATS, FloatFormat, get_format  # noqa: F401,E402
from .codebook import Codebook  # noqa: F401,E402
from .calibrate import calibrate  # noqa: F401,E402
from .channel_codebook import ChannelCodebook, calibrate_channels  # noqa: F401,E402
from .pipeline import Pipeline  # noqa: F401,E402
from .api import (compress, compress_bound, compress_into, compress_many, decompress, decompress_into,  # noqa: F401,E402
                  decompress_many, info, ratio_pipeline, splitzip_pipeline,
                  storage_pipeline)
from .into import status_text  # noqa: F401,E402
from .packed import pack, unpack  # noqa: F401,E402
from . import stages  # noqa: F401,E402  (kvzip.stages: the stage classes)

from .version import __version__  # noqa: E402
__all__ = ["compress", "decompress", "compress_many", "decompress_many", "compress_into", "decompress_into",
           "compress_bound", "status_text", "info", "pack", "unpack", "calibrate", "calibrate_channels", "Codebook",
           "ChannelCodebook", "Pipeline",
           "FormatError", "stages", "splitzip_pipeline", "ratio_pipeline", "storage_pipeline", "FloatFormat", "get_format", "FORMATS"]
