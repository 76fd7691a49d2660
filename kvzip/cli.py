"""The ``kvzip`` command: compress and restore files, inspect them, calibrate codebooks, demo
and benchmark the codec.

    kvzip compress IN OUT [--mode speed|ratio|storage] [--dtype bf16] [--checksum] [--codebook auto|NAME|FILE.json] [--force]
    kvzip decompress IN OUT [--force]
    kvzip info FILE [--json]
    kvzip calibrate kv.safetensors [...] -o my-model.json [--mode speed|ratio] [--format bf16] [--name NAME]
    kvzip demo [--backend cpu|cuda] [--repeat N]
    kvzip bench [--device cpu|cuda] [...]

Each subcommand is one ``_add_<name>(subparsers)`` function, listed in COMMANDS, that registers
its parser and sets ``run`` to the function implementing it; ``main`` dispatches.  A subcommand
with an argparse of its own goes in DELEGATED instead (one line), and gets every argument after
its name.  Runners return the exit status (EXIT_*).
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_FILE, EXIT_WRONG_KIND, EXIT_CORRUPT = 0, 1, 2, 3, 4, 5
EXIT_CODES = (f"exit status: {EXIT_OK} done, {EXIT_FAILED} failed, {EXIT_USAGE} bad usage, {EXIT_NO_FILE} no such "
              f"file, {EXIT_WRONG_KIND} wrong kind of file, {EXIT_CORRUPT} corrupt file")

# name -> (one-line help, "module:function" called with the arguments after the name)
DELEGATED: dict[str, tuple[str, str]] = {
    "pd-demo": ("prefill/decode demo: SmolLM2 streams its KV to a decode process over Mooncake, raw vs kvzip",
                "kvzip.transfer.demo:main"),
    "weights": ("compressed checkpoints of model weights: compress, decompress, info, verify", "kvzip.weights.cli:main"),
}


class CommandError(Exception):
    """A one-line failure of a command, with its exit status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def build_parser() -> argparse.ArgumentParser:
    from .version import __version__

    parser = argparse.ArgumentParser(prog="kvzip", description="Lossless compression of LLM tensors (KV caches, "
                                     "checkpoints): BF16 to ~1.33x, every bit kept, on the GPU or the CPU.",
                                     epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"kvzip {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    for name, (text, _) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)  # listed in --help; main() hands it its arguments
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in DELEGATED:
        module, func = DELEGATED[argv[0]][1].split(":")
        return getattr(importlib.import_module(module), func)(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CommandError as e:
        return _fail(args.command, e, e.status)
    except BrokenPipeError:  # `kvzip info ... | head`: the reader left; no traceback
        sys.stdout = None
        return EXIT_FAILED


def _fail(command: str, message, status: int = EXIT_FAILED) -> int:
    print(f"kvzip {command}: error: {message}", file=sys.stderr)
    return status


def _progress(total: int, desc: str, quiet: bool):
    """A byte progress bar on stderr (tqdm; off when quiet or stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                disable=True if quiet else None, file=sys.stderr)


# ---- compress / decompress / info -------------------------------------------------------------

def _add_compress(sub) -> None:
    p = sub.add_parser("compress", help="compress a .safetensors, .npy, .pt or raw file losslessly",
                       description="Compress IN to OUT losslessly.  A .safetensors file gives a .safetensors "
                                   "file of the same tensors, each floating one (BF16, F16, F32, F8) as a kvzip "
                                   "blob, names and metadata kept (`kvzip decompress` restores the original "
                                   "file byte for byte); a .pt state dict (str -> tensor) the same, restored as "
                                   ".pt or .safetensors.  A .npy file, a .pt file of one tensor or a raw file "
                                   "of values (with --dtype) gives one kvzip blob.",
                       epilog=EXIT_CODES)
    _add_in_out(p, "file to compress (its kind is told by its first bytes)", "file to write")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "e4m3", "e5m2"),
                   help="format of the values of a raw file, or of a .npy of raw bits (NumPy saves bfloat16 as "
                        "2-byte void items); not needed otherwise")
    p.add_argument("--mode", choices=("speed", "ratio", "storage"), default="speed",  # kvzip.api.MODES
                   help="speed (default: the Top-16 code the GPU kernels run), ratio (per-channel codes chosen "
                        "from each tensor, or from `kvzip calibrate --mode ratio`: smaller files) or storage "
                        "(per-channel rANS: smaller still, slower; no --codebook)")
    p.add_argument("--checksum", action="store_true", help="add a 64-bit payload checksum, verified on decode")
    p.add_argument("--codebook", metavar="auto|NAME|FILE.json", default="auto",
                   help="auto (the default: each tensor's own codebook, chosen from it), a shipped codebook name "
                        "(bf16-kv, ...; --mode speed) or a file from `kvzip calibrate` (--mode speed) or "
                        "`kvzip calibrate --mode ratio` (--mode ratio)")
    p.set_defaults(run=_run_compress)


def _add_in_out(p, in_help: str, out_help: str) -> None:
    """IN, OUT and the options about writing OUT, shared by compress and decompress."""
    p.add_argument("input", type=Path, metavar="IN", help=in_help)
    p.add_argument("output", type=Path, metavar="OUT", help=out_help)
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors, no progress bar")


def _add_decompress(sub) -> None:
    p = sub.add_parser("decompress", help="restore a file that kvzip compress wrote",
                       description="Restore IN, written by `kvzip compress`, to OUT.  A compressed .safetensors "
                                   "file gives back the original file, byte for byte (or, when OUT ends with "
                                   ".pt, its tensors as a torch state dict).  A kvzip blob gives its "
                                   "tensor as .npy or .pt when OUT ends so, else its raw bytes.",
                       epilog=EXIT_CODES)
    _add_in_out(p, "a kvzip blob or a compressed .safetensors file",
                "file to write (.npy, .pt, or anything for raw bytes)")
    p.set_defaults(run=_run_decompress)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="show what a kvzip file holds, without decoding it",
                       description="Show format, shape, ratio, escape rate, pipeline and checksum of a kvzip "
                                   "blob, or of every tensor of a compressed .safetensors file.",
                       epilog=EXIT_CODES)
    p.add_argument("file", type=Path, metavar="FILE", help="a kvzip blob or a compressed .safetensors file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=_run_info)


def _existing_kind(path: Path) -> str:
    from .files import kind_of

    if not path.is_file():
        raise CommandError(EXIT_NO_FILE, f"no such file: {path}")
    try:
        return kind_of(path)
    except OSError as e:
        raise CommandError(EXIT_NO_FILE, f"cannot read {path}: {e.strerror or e}") from None


def _check_output(args) -> None:
    if args.output.exists() and not args.force:
        raise CommandError(EXIT_FAILED, f"{args.output} exists (--force overwrites it)")
    if args.output.resolve() == args.input.resolve():
        raise CommandError(EXIT_FAILED, "IN and OUT are the same file")


def _codebook(arg: str, mode: str):
    """--codebook for --mode: "auto", a shipped name (speed), or a JSON file of the mode's kind."""
    if arg == "auto":
        return arg
    if mode == "storage":
        raise CommandError(EXIT_USAGE, "--codebook is for --mode speed or ratio: the storage mode chooses its tables "
                                       "from each tensor")
    if mode == "ratio" and not arg.endswith(".json"):
        raise CommandError(EXIT_USAGE, f"--mode ratio takes --codebook auto or a FILE.json from `kvzip calibrate --mode "
                                       f"ratio`, not {arg!r}")
    if not arg.endswith(".json"):
        return arg
    from .channel_codebook import ChannelCodebook
    from .codebook import Codebook

    try:
        return (ChannelCodebook if mode == "ratio" else Codebook).from_json(arg)
    except (OSError, ValueError, TypeError) as e:
        raise CommandError(EXIT_FAILED, f"cannot load codebook {arg}: {e}") from None


class _Errors:
    """Library exceptions as one-line command errors: a malformed input is corrupt, a value kvzip
    refuses (an integer tensor, a bad dtype) the wrong kind, an OS error a failure."""

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        from .errors import FormatError
        from .files import WrongKind

        if kind is None or issubclass(kind, CommandError):
            return False
        if issubclass(kind, FormatError):
            raise CommandError(EXIT_CORRUPT, f"corrupt file: {e}") from None
        if issubclass(kind, WrongKind):
            raise CommandError(EXIT_WRONG_KIND, str(e)) from None
        if issubclass(kind, (TypeError, ValueError)):
            raise CommandError(EXIT_WRONG_KIND, str(e)) from None
        if issubclass(kind, OSError):
            raise CommandError(EXIT_FAILED, f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None
        return False


def _report(args, what: str, raw: int, stored: int, seconds: float) -> None:
    if not args.quiet:
        ratio = raw / stored if stored else float("nan")
        print(f"{args.input} -> {args.output}: {what}, {raw / 1e6:.3f} MB raw, {stored / 1e6:.3f} MB stored, "
              f"ratio {ratio:.4f}, {seconds:.2f} s ({raw / max(seconds, 1e-9) / 1e6:.0f} MB/s)")


def _run_compress(args) -> int:
    import kvzip
    from . import files

    kind = _existing_kind(args.input)
    _check_output(args)
    codebook = _codebook(args.codebook, args.mode)

    def compress(x, dtype):
        return kvzip.compress(x, codebook=codebook, mode=args.mode, checksum=args.checksum, dtype=dtype,
                              backend="cpu")

    t0 = time.perf_counter()
    with _Errors():
        if kind == "kvzip":
            raise files.WrongKind(f"{args.input} is a kvzip blob already")
        if kind == "safetensors":
            st = files.read_safetensors(args.input)
            if files.is_archive(st):
                raise files.WrongKind(f"{args.input} is a compressed .safetensors file already")
            with _progress(int(st.data.nbytes), "compress", args.quiet) as bar:
                done = files.compress_safetensors(st, args.output, compress, bar.update)
            _report(args, f"{done['compressed']} of {done['tensors']} tensors compressed", done["raw_bytes"],
                    done["bytes"], time.perf_counter() - t0)
            return EXIT_OK
        x, dtype, what = _load_tensor(args, kind)
        if isinstance(x, files.SafetensorsFile):  # a .pt state dict
            with _progress(int(x.data.nbytes), "compress", args.quiet) as bar:
                done = files.compress_safetensors(x, args.output, compress, bar.update)
            _report(args, f"{what}: {done['compressed']} of {done['tensors']} tensors compressed",
                    int(x.data.nbytes), done["bytes"], time.perf_counter() - t0)
            return EXIT_OK
        blob = np.asarray(compress(x, dtype))
        files.write_atomic(args.output, [blob])
        _report(args, what, int(np.asarray(x).nbytes) if not hasattr(x, "element_size") else
                x.numel() * x.element_size(), blob.nbytes, time.perf_counter() - t0)
    return EXIT_OK


def _load_tensor(args, kind: str):
    """(array, dtype argument for kvzip.compress, description) of a .npy, .pt or raw file."""
    from . import files

    if kind == "npy":
        try:
            x = np.load(args.input, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise files.WrongKind(f"{args.input}: {e}") from None
        if x.dtype.kind == "V" and args.dtype is None:
            raise files.WrongKind(f"{args.input} holds {x.dtype.itemsize}-byte void items (how NumPy saves "
                                  "bfloat16): give --dtype bf16")
        if x.dtype.kind == "V":
            x = x.view(f"<u{x.dtype.itemsize}")
        return x, args.dtype, f".npy {x.dtype} {list(x.shape)}"
    if kind == "pt":
        try:
            import torch
        except ImportError:
            raise CommandError(EXIT_FAILED, "reading a .pt file needs torch (pip install torch --index-url "
                                            "https://download.pytorch.org/whl/cpu)") from None
        try:
            x = torch.load(args.input, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
            raise files.WrongKind(f"{args.input} is not a loadable .pt file: {str(e).splitlines()[0]}") from None
        if isinstance(x, dict):
            return _pt_dict(args, x, torch), None, f".pt dict of {len(x)} tensors"
        if not isinstance(x, torch.Tensor):
            raise files.WrongKind(f"{args.input} holds a {type(x).__name__}, not a tensor or a dict of tensors")
        return x.contiguous(), args.dtype, f".pt {str(x.dtype).replace('torch.', '')} {list(x.shape)}"
    if args.dtype is None:
        raise files.WrongKind(f"{args.input} is not a .safetensors, .npy, .pt or kvzip file; to compress it as "
                              "raw values, give their --dtype")
    from .formats import get_format

    fmt = get_format(args.dtype)
    x = np.fromfile(args.input, dtype=np.uint8)
    if x.nbytes % fmt.itemsize:
        raise files.WrongKind(f"{args.input}: {x.nbytes} bytes is not a whole number of {args.dtype} values")
    return x.view(fmt.uint_dtype), args.dtype, f"raw {args.dtype} values"


_TORCH_SAFETENSORS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
                      "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32",
                      "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _pt_dict(args, state: dict, torch):
    """A .pt dict of tensors as the .safetensors file it makes (in memory)."""
    from . import files

    arrays = {}
    for name, t in state.items():
        st_dtype = _TORCH_SAFETENSORS.get(str(t.dtype).replace("torch.", "")) if isinstance(t, torch.Tensor) else None
        if not isinstance(name, str) or st_dtype is None:
            what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a {t.dtype} tensor"
            raise files.WrongKind(f"{args.input}: entry {name!r} is {what}; only a flat dict of str to tensors of "
                                  f"{', '.join(sorted(_TORCH_SAFETENSORS))} is taken")
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        arrays[name] = (st_dtype, tuple(t.shape), raw)
    return files.safetensors_of_arrays(arrays, {"kvzip.source": "pt"})


def _save_pt_dict(st, path: Path) -> None:
    """torch.save of the tensors of a .safetensors file (one written by restore_safetensors)."""
    import torch

    from . import files

    from_safetensors = {v: k for k, v in _TORCH_SAFETENSORS.items()}
    out = {}
    for name, e in st.entries.items():
        torch_name = from_safetensors.get(e["dtype"])
        if torch_name is None:
            raise files.WrongKind(f"tensor {name!r} is {e['dtype']}, which a .pt file of this kind does not hold; "
                                  "decompress to .safetensors")
        a, b = e["data_offsets"]
        raw = torch.from_numpy(np.array(st.data[a:b]))
        out[name] = raw.view(getattr(torch, torch_name)).reshape(e["shape"])
    with files.atomic_output(path) as f:
        torch.save(out, f)


def _run_decompress(args) -> int:
    import kvzip
    from . import files

    kind = _existing_kind(args.input)
    _check_output(args)
    t0 = time.perf_counter()
    with _Errors():
        if kind == "safetensors":
            st = files.read_safetensors(args.input)
            if not files.is_archive(st):
                raise files.WrongKind(f"{args.input} is a .safetensors file kvzip did not compress")

            def restore(blob, entry):
                x = kvzip.decompress(blob, backend="cpu")
                want = files.SAFETENSORS_FORMATS[entry["dtype"]]
                if list(x.shape) != list(entry["shape"]) or kvzip.get_format(x.dtype.name).name != want:
                    raise kvzip.FormatError(f"a blob holds {x.dtype} {list(x.shape)}, the header says "
                                            f"{entry['dtype']} {entry['shape']}")
                return np.ascontiguousarray(x).reshape(-1).view(np.uint8)

            as_pt = args.output.suffix.lower() == ".pt"
            target = args.output.with_name(f".{args.output.name}.safetensors") if as_pt else args.output
            with _progress(int(st.data.nbytes), "decompress", args.quiet) as bar:
                done = files.restore_safetensors(st, target, restore, bar.update)
            if as_pt:  # a state dict: the restored .safetensors file, saved by torch
                try:
                    _save_pt_dict(files.read_safetensors(target), args.output)
                finally:
                    target.unlink()
            _report(args, f"{done['tensors']} tensors restored", done["bytes"], args.input.stat().st_size,
                    time.perf_counter() - t0)
            return EXIT_OK
        if kind != "kvzip":
            raise files.WrongKind(f"{args.input} is not a kvzip file (it looks like {_KIND_NAMES[kind]})")
        blob = np.fromfile(args.input, dtype=np.uint8)
        x = kvzip.decompress(blob, backend="cpu")
        suffix = args.output.suffix.lower()
        if suffix == ".npy":
            with files.atomic_output(args.output) as f:
                np.save(f, x, allow_pickle=False)
        elif suffix == ".pt":
            _save_pt(x, args.output)
        else:
            files.write_atomic(args.output, [np.ascontiguousarray(x).reshape(-1).view(np.uint8)])
        _report(args, f"{x.dtype} {list(x.shape)}", int(x.nbytes), blob.nbytes, time.perf_counter() - t0)
    return EXIT_OK


_KIND_NAMES = {"safetensors": "a .safetensors file", "npy": "a .npy file", "pt": "a .pt file",
               "raw": "raw data", "kvzip": "a kvzip blob"}


def _save_pt(x: np.ndarray, path: Path) -> None:
    try:
        import torch
    except ImportError:
        raise CommandError(EXIT_FAILED, "writing a .pt file needs torch") from None
    from . import files
    from .formats import get_format

    fmt = get_format(x.dtype.name)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                   "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt.name]
    signed = {1: np.int8, 2: np.int16, 4: np.int32}[fmt.itemsize]  # torch has no uint16/uint32 views everywhere
    t = torch.from_numpy(np.ascontiguousarray(x).view(signed).copy()).view(torch_dtype)
    with files.atomic_output(path) as f:
        torch.save(t, f)


def _blob_info(blob) -> dict:
    import kvzip

    meta = kvzip.info(blob)
    meta["shape"] = list(meta["shape"])
    return meta


def _run_info(args) -> int:
    from . import files

    kind = _existing_kind(args.file)
    with _Errors():
        if kind == "kvzip":
            meta = _blob_info(np.fromfile(args.file, dtype=np.uint8))
            doc = {"file": str(args.file), "kind": "kvzip blob", **meta}
        elif kind == "safetensors":
            st = files.read_safetensors(args.file)
            if not files.is_archive(st):
                raise files.WrongKind(f"{args.file} is a .safetensors file kvzip did not compress")
            tensors = {}
            for name, (entry, stored, blob) in files.archive_tensors(st).items():
                if blob:
                    tensors[name] = {"compressed": True, **_blob_info(np.asarray(stored))}
                else:
                    tensors[name] = {"compressed": False, "dtype": entry["dtype"], "shape": entry["shape"],
                                     "raw_bytes": int(stored.nbytes), "compressed_bytes": int(stored.nbytes)}
            raw = sum(t["raw_bytes"] for t in tensors.values())
            stored = sum(t["compressed_bytes"] for t in tensors.values())
            doc = {"file": str(args.file), "kind": "compressed safetensors",
                   "metadata": {k: v for k, v in st.metadata.items() if k != files.ARCHIVE_KEY},
                   "raw_bytes": raw, "compressed_bytes": stored, "ratio": raw / stored if stored else float("nan"),
                   "tensors": tensors}
        else:
            raise files.WrongKind(f"{args.file} is not a kvzip file (it looks like {_KIND_NAMES[kind]})")
    if args.json:
        print(json.dumps(doc, indent=1))
    elif "tensors" in doc:
        _print_archive_info(doc)
    else:
        _print_blob_info(doc)
    return EXIT_OK


def _pipeline_text(pipeline) -> str:
    if not isinstance(pipeline, list):
        return "stored raw" if pipeline is None else str(pipeline)
    return " -> ".join(str(stage.get("id")) if isinstance(stage, dict) else str(stage) for stage in pipeline)


def _print_blob_info(d: dict) -> None:
    rows = [("file", d["file"]), ("kind", d["kind"]), ("dtype", d["dtype"]), ("shape", d["shape"]),
            ("bytes", f"{d['raw_bytes']:,} raw, {d['compressed_bytes']:,} compressed"),
            ("ratio", f"{d['ratio']:.4f}"), ("escapes", f"{d['escapes']:,} ({d['escape_rate']:.4%}), "
                                                        f"{d['raw_chunks']} of {d['chunks']} chunks plane-coded"),
            ("stored raw", "yes" if d["stored_raw"] else "no"), ("checksum", "yes" if d["checksum"] else "no"),
            ("codebook", d["codebook"] or "-"), ("pipeline", _pipeline_text(d["pipeline"]))]
    for key, value in rows:
        print(f"{key:<11} {value}")


def _print_archive_info(d: dict) -> None:
    print(f"{d['file']}: {d['kind']}, {len(d['tensors'])} tensors, {d['raw_bytes']:,} B raw, "
          f"{d['compressed_bytes']:,} B stored, ratio {d['ratio']:.4f}")
    if d["metadata"]:
        print(f"metadata: {json.dumps(d['metadata'])[:200]}")
    head = f"{'tensor':<32} {'dtype':<9} {'shape':<18} {'ratio':>7} {'escapes':>9} {'checksum':>8}"
    print(head)
    print("-" * len(head))
    for name, t in d["tensors"].items():
        if t["compressed"]:
            print(f"{name:<32} {t['dtype']:<9} {str(t['shape']):<18} {t['ratio']:>7.4f} {t['escape_rate']:>9.4%} "
                  f"{'yes' if t['checksum'] else 'no':>8}")
        else:
            print(f"{name:<32} {t['dtype']:<9} {str(t['shape']):<18} {'as is':>7} {'-':>9} {'-':>8}")


# ---- calibrate -------------------------------------------------------------------------------

def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate a codebook on .safetensors KV files",
                       description="Count exponents in every tensor of the given .safetensors files and "
                                   "write a codebook as JSON: the speed mode's Top-16 (use it with "
                                   "kvzip.compress(x, codebook=kvzip.Codebook.from_json(path)) or kvzip compress "
                                   "--codebook) or, with --mode ratio, the ratio mode's per-channel tables "
                                   "(kvzip.compress(x, mode='ratio', codebook=kvzip.ChannelCodebook.from_json(path)) "
                                   "or kvzip compress --mode ratio --codebook).")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help=".safetensors file(s) of KV tensors")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="OUT.json", help="codebook to write")
    p.add_argument("--mode", choices=("speed", "ratio"), default="speed",
                   help="speed (default: a Top-16 codebook) or ratio (a table of 15 exponents for each channel, "
                        "the tensors' last axis: every tensor must have the same)")
    p.add_argument("--format", help="float format (bf16, fp16, fp32, e4m3, e5m2); needed only if the "
                                    "files hold raw integer bits, else checked against them")
    p.add_argument("--name", help="codebook name (default: the output file's stem)")
    p.add_argument("--always-include", type=int, nargs="*", default=None, metavar="EXP",
                   help="--mode speed: exponents the codebook must hold (default: 0, for zeros and subnormals; "
                        "give none for the plain Top-16)")
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args) -> int:
    from .calibrate import calibrate
    from .channel_codebook import calibrate_channels

    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        return _fail("calibrate", f"no such file: {', '.join(missing)}")
    if args.mode == "ratio" and args.always_include is not None:
        return _fail("calibrate", "--always-include is for --mode speed: a channel's table holds its 15 most frequent "
                                  "exponents", EXIT_USAGE)
    name = args.name or args.output.stem
    try:
        with _progress(sum(f.stat().st_size for f in args.files), "calibrate", False) as bar:
            if args.mode == "ratio":
                cb = calibrate_channels(args.files, format=args.format, name=name, progress=bar.update)
            else:
                include = (0,) if args.always_include is None else tuple(args.always_include)
                cb = calibrate(args.files, format=args.format, name=name, always_include=include, progress=bar.update)
    except (ValueError, TypeError, ImportError) as e:
        return _fail("calibrate", e)
    prov = cb.provenance
    if args.mode == "ratio":
        print(f"{name}: {cb.format.name} tables of {cb.channels} channels from {prov['values']:,} values in "
              f"{prov['tensors']} tensors")
    else:
        print(f"{name}: {cb.format.name} codebook from {prov['values']:,} values in {prov['tensors']} tensors")
        print(f"coverage {cb.coverage:.4%} (escape rate {1 - cb.coverage:.4%})")
        print(f"exponents, code 0 first: {list(cb.exponents)}")
    try:
        cb.to_json(args.output)
    except OSError as e:
        return _fail("calibrate", e)
    print(f"wrote {args.output}")
    return 0


# ---- demo ------------------------------------------------------------------------------------

def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="compress the shipped real KV sample and check the round trip",
                       description="Compress and decompress the KV sample shipped with kvzip (SmolLM2-135M, "
                                   "prose / code / HTML), check every bit, and report ratio and speed.")
    p.add_argument("--backend", choices=("cpu", "cuda"), default=None,
                   help="where to run (default: cuda if a CUDA GPU and CuPy are available, else cpu)")
    p.add_argument("--repeat", type=_positive_int, default=5, metavar="N",
                   help="timed runs after one warm-up; the median is reported (default 5)")
    p.set_defaults(run=_run_demo)


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _default_backend() -> str:
    try:
        import cupy

        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # no CuPy, no driver, no device: all mean "not here"
        return "cpu"


def _run_demo(args) -> int:
    with warnings.catch_warnings():
        # Numba flags small grids; a 6 MB sample makes small grids on purpose.
        warnings.filterwarnings("ignore", message=".*GPU under-utilization")
        return _demo(args)


def _demo(args) -> int:
    import kvzip
    from .data import SAMPLE_KINDS, load_sample

    backend = args.backend or _default_backend()
    if backend == "cuda":
        try:
            import cupy
        except ImportError:
            return _fail("demo", "--backend cuda needs CuPy and a CUDA GPU: pip install 'kvzip[gpu]'")

        # CuPy has no bfloat16: the sample goes up as its uint16 bits, with dtype= saying what
        # they are, and comes back as uint16 bits.
        dtype, to_device, to_host = "bfloat16", cupy.asarray, cupy.asnumpy
        sync = cupy.cuda.Device().synchronize
    else:
        dtype, to_device, to_host = None, np.asarray, np.asarray

        def sync():
            pass

    print(f"kvzip demo: real SmolLM2-135M KV (shipped sample), backend {backend}, "
          f"median of {args.repeat} run(s) after a warm-up")
    header = (f"{'kind':<6} {'values':>10} {'raw MB':>8} {'comp MB':>8} {'ratio':>7} {'escapes':>8} "
              f"{'enc GB/s':>9} {'dec GB/s':>9}  exact")
    print(header)
    print("-" * len(header))
    failed = []
    totals = dict(values=0, raw=0, comp=0, escapes=0, t_enc=0.0, t_dec=0.0)
    for kind in SAMPLE_KINDS:
        sample = np.stack(list(load_sample(kind).values()))  # bfloat16 [layers*2, 3, tokens, 64]
        host = sample.view(np.uint16)
        x = to_device(host) if dtype else sample

        def encode():
            return kvzip.compress(x, dtype=dtype, backend=backend)

        t_enc, blob = _median_time(encode, args.repeat, sync)
        t_dec, back = _median_time(lambda: kvzip.decompress(blob, backend=backend), args.repeat, sync)
        got = np.asarray(to_host(back))
        exact = got.shape == host.shape and np.array_equal(got.view(np.uint16), host)
        if not exact:
            failed.append(kind)
        meta = kvzip.info(blob)
        raw, comp = meta["raw_bytes"], meta["compressed_bytes"]
        print(f"{kind:<6} {host.size:>10,} {raw / 1e6:>8.3f} {comp / 1e6:>8.3f} {meta['ratio']:>7.4f} "
              f"{meta['escape_rate']:>8.4%} {raw / t_enc / 1e9:>9.3f} {raw / t_dec / 1e9:>9.3f}  "
              f"{'yes' if exact else 'NO'}")
        for key, value in (("values", host.size), ("raw", raw), ("comp", comp), ("escapes", meta["escapes"]),
                           ("t_enc", t_enc), ("t_dec", t_dec)):
            totals[key] += value
    t = totals
    print(f"{'all':<6} {t['values']:>10,} {t['raw'] / 1e6:>8.3f} {t['comp'] / 1e6:>8.3f} "
          f"{t['raw'] / t['comp']:>7.4f} {t['escapes'] / t['values']:>8.4%} "
          f"{t['raw'] / t['t_enc'] / 1e9:>9.3f} {t['raw'] / t['t_dec'] / 1e9:>9.3f}  "
          f"{'NO' if failed else 'yes'}")
    print("GB/s: uncompressed bytes per second of wall time, median.", end=" ")
    if backend == "cpu":
        print("`kvzip bench --device cpu` sets kvzip beside zstd and lz4 on 64 MiB.")
    else:
        print("A ~6 MB sample cannot fill a GPU: throughput at scale needs far more values.")
    if failed:
        return _fail("demo", f"round trip NOT bit-exact for: {', '.join(failed)}")
    return 0


def _median_time(fn, repeat: int, sync):
    """(median seconds of ``repeat`` timed calls after one warm-up, the last result)."""
    out = fn()  # warm-up: JIT compilation, allocator pools
    sync()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


# ---- bench -----------------------------------------------------------------------------------

def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark kvzip: on the CPU against zstd and lz4, or on a CUDA GPU",
                       description="--device cpu: kvzip (all cores, one thread, with and without checksum) and, "
                                   "when installed, zstd -1 and lz4 on the same real KV bytes (the sample shipped "
                                   "with kvzip, tiled to --mib MiB, or --file), a table side by side.  --device "
                                   "cuda: the GPU benchmark (kvzip/bench.py) against the copy roofline and nvCOMP.",
                       epilog=EXIT_CODES)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where to benchmark (default: cuda if a CUDA GPU and CuPy are available, else cpu)")
    p.add_argument("--repeat", type=_positive_int, default=None, metavar="N",
                   help="timed runs per measurement after a warm-up, median reported (default: cpu 5, cuda 20)")
    cpu = p.add_argument_group("cpu options")
    cpu.add_argument("--mib", type=_positive_int, default=64, metavar="MIB",
                     help="MiB of BF16 values to compress (default 64)")
    cpu.add_argument("--file", type=Path, metavar="FILE.safetensors",
                     help="take the BF16 tensors of this file, concatenated, instead of the shipped sample")
    cpu.add_argument("--json", type=Path, metavar="OUT.json", help="also write the rows, machine and versions")
    gpu = p.add_argument_group("cuda options")
    gpu.add_argument("--values-log2", type=int, default=28, metavar="K", help="2^K values (default 28)")
    gpu.add_argument("--out", default="benchmarks/results", metavar="DIR",
                     help="folder for <gpu>.json and .png (default benchmarks/results)")
    gpu.add_argument("--quick", action="store_true", help="skip nvCOMP")
    gpu.add_argument("--replot", metavar="JSON", help="only redraw the plot of an existing results file")
    p.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    device = args.device or ("cpu" if args.replot is None and _default_backend() == "cpu" else "cuda")
    if device == "cuda":
        from .bench import main as gpu_main

        argv = ["--values-log2", str(args.values_log2), "--repeat", str(args.repeat or 20), "--out", args.out]
        argv += ["--quick"] * args.quick + (["--replot", args.replot] if args.replot else [])
        return gpu_main(argv)
    from . import bench_cpu
    from .cpu_parallel import available_cores

    with _Errors():
        if args.file is None:
            x, source = bench_cpu.sample_bf16(args.mib << 20), f"the shipped SmolLM2 KV sample tiled to {args.mib} MiB"
        else:
            if not args.file.is_file():
                raise CommandError(EXIT_NO_FILE, f"no such file: {args.file}")
            x, source = _bf16_of(args.file, args.mib << 20), f"the BF16 tensors of {args.file}"
        repeat = args.repeat or 5
        print(f"kvzip bench --device cpu: {x.nbytes / 2**20:.1f} MiB of {source}, {available_cores()} "
              f"core(s), median of {repeat} after a warm-up", flush=True)
        from tqdm import tqdm

        with tqdm(desc="bench", leave=False, file=sys.stderr, disable=None) as bar:
            def step(done, total, name):
                bar.total = total
                bar.set_description(name)
                bar.update(done - bar.n)

            rows = bench_cpu.run(x, repeat, progress=step)
    print(bench_cpu.format_table(rows))
    print("MB/s: uncompressed bytes per second of wall time.  zstandard / lz4 rows: pip install 'kvzip[bench]'.")
    if args.json is not None:
        doc = {**bench_cpu.environment(), "input": source, "bytes": int(x.nbytes), "repeat": repeat, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return EXIT_OK if all(r["exact"] for r in rows) else _fail("bench", "a round trip was not exact")


def _bf16_of(path: Path, nbytes: int):
    import ml_dtypes

    from . import files

    if files.kind_of(path) != "safetensors":
        raise files.WrongKind(f"{path} is not a .safetensors file")
    st = files.read_safetensors(path)
    parts = [st.data[e["data_offsets"][0]:e["data_offsets"][1]] for e in st.entries.values() if e["dtype"] == "BF16"]
    if not parts:
        raise files.WrongKind(f"{path} holds no BF16 tensor")
    bits = np.concatenate(parts).view(np.uint16)
    return bits[: nbytes // 2].view(ml_dtypes.bfloat16)


COMMANDS = (_add_compress, _add_decompress, _add_info, _add_calibrate, _add_demo, _add_bench)


if __name__ == "__main__":
    sys.exit(main())
