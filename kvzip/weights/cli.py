"""``kvzip weights``: compressed checkpoints of model weights (kvzip/weights/checkpoint.py).

    kvzip weights compress IN OUT [--force] [--quiet]
    kvzip weights decompress IN OUT [--force] [--quiet]
    kvzip weights info FILE [--json]
    kvzip weights verify FILE [--against ORIGINAL] [--quiet]

IN, FILE and ORIGINAL are a .safetensors file or a sharded checkpoint: its
*.safetensors.index.json, or the folder holding it (OUT is then a folder).  kvzip/cli.py's DELEGATED
table hands this module every argument after ``weights``; errors are one line with kvzip's exit
statuses.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .. import files
from ..cli import (EXIT_CODES, EXIT_CORRUPT, EXIT_FAILED, EXIT_NO_FILE, EXIT_OK, CommandError,
                   _Errors as LibraryErrors, _fail as fail, _progress as progress_bar)  # kvzip's own, shared
from . import checkpoint, sharded
from .index import find_index, read_index, shards

SOURCE_HELP = "a .safetensors file, or a sharded checkpoint: its *.safetensors.index.json or its folder"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvzip weights", epilog=EXIT_CODES,
        description="Compressed checkpoints of model weights: every tensor of a .safetensors checkpoint kept byte "
                    "for byte, BF16 ~1.5x smaller (FP16, FP32 less), still a valid .safetensors file; decoded once "
                    "at load (kvzip.weights.checkpoint.load_compressed).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compress", help="compress a checkpoint", epilog=EXIT_CODES,
                       description="Compress IN into OUT: each tensor as a blob (exponent Huffman-coded for BF16, "
                                   "FP16 and FP32, else raw) held as a U8 tensor of its name, the original header "
                                   "and every tensor's sha256 in the metadata.")
    _in_out(p, SOURCE_HELP, "file to write (a folder for a sharded checkpoint)")
    p.set_defaults(run=run_compress)

    p = sub.add_parser("decompress", help="restore the original checkpoint, byte for byte", epilog=EXIT_CODES,
                       description="Write the original checkpoint of IN (written by `kvzip weights compress`) "
                                   "to OUT: the same bytes, header and metadata included.")
    _in_out(p, "a compressed checkpoint (file, index or folder)", "file to write (a folder for a sharded one)")
    p.set_defaults(run=run_decompress)

    p = sub.add_parser("info", help="per-tensor sizes, ratio and coding, nothing decoded", epilog=EXIT_CODES,
                       description="Show every tensor of a compressed checkpoint: name, dtype, shape, raw and "
                                   "stored bytes, ratio and coding, and the totals.")
    p.add_argument("file", type=Path, metavar="FILE", help="a compressed checkpoint (file, index or folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_info)

    p = sub.add_parser("verify", help="decode every tensor and check its sha256", epilog=EXIT_CODES,
                       description="Decode every tensor of a compressed checkpoint and check its sha256 against "
                                   "the digest recorded at compression; with --against, also the original's "
                                   "tensors, names, dtypes, shapes and metadata.  Exit status 5 if a tensor is "
                                   "corrupt, 1 if only the original differs.")
    p.add_argument("file", type=Path, metavar="FILE", help="a compressed checkpoint (file, index or folder)")
    p.add_argument("--against", type=Path, metavar="ORIGINAL", help="the uncompressed checkpoint to compare with")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors, no progress bar")
    p.set_defaults(run=run_verify)
    return parser


def _in_out(p, in_help: str, out_help: str) -> None:
    p.add_argument("input", type=Path, metavar="IN", help=in_help)
    p.add_argument("output", type=Path, metavar="OUT", help=out_help)
    p.add_argument("-f", "--force", action="store_true", help="overwrite files that exist")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors, no progress bar")


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        with LibraryErrors():
            try:
                return args.run(args)
            except BrokenPipeError:  # `kvzip weights info ... | head`: the reader left; no traceback
                sys.stdout = None
                return EXIT_FAILED
    except CommandError as e:
        return fail(f"weights {args.command}", e, e.status)


# ---- what the paths name ----------------------------------------------------------------------

def _source(path: Path) -> Path | None:
    """The index of the sharded checkpoint path names, or None when it is a .safetensors file."""
    if not path.exists():
        raise CommandError(EXIT_NO_FILE, f"no such file: {path}")
    index = find_index(path)
    if index is None:
        if not path.is_file() or files.kind_of(path) != "safetensors":
            raise files.WrongKind(f"{path} is not a .safetensors file (nor a sharded checkpoint's index or folder)")
    elif not index.is_file():
        raise CommandError(EXIT_NO_FILE, f"no such file: {index}")
    return index


def _outputs(args, index: Path | None, names: list[str]) -> list[Path]:
    """The files the command will write, checked: none exists unless --force, none is an input."""
    if index is None:
        targets, inputs = [args.output], [args.input]
    else:
        if args.output.is_file():
            raise CommandError(EXIT_FAILED, f"{args.output} is a file; a sharded checkpoint goes to a folder")
        targets = [args.output / n for n in names] + [args.output / index.name]
        inputs = [index.parent / n for n in names] + [index]
    if {t.resolve() for t in targets} & {i.resolve() for i in inputs}:
        raise CommandError(EXIT_FAILED, "OUT would overwrite IN")
    existing = [t for t in targets if t.exists()]
    if existing and not args.force:
        raise CommandError(EXIT_FAILED, f"{existing[0]} exists (--force overwrites it)")
    return inputs


def _run(args, what: str, single, many, names_of) -> int:
    """compress / decompress: single(src, dst, progress) for a file, many(index, dir, progress)
    for a sharded checkpoint; names_of(index) -> the shard names it will write."""
    index = _source(args.input)
    inputs = _outputs(args, index, names_of(index) if index else [])
    total = sum(p.stat().st_size for p in inputs if p != index)  # the checkpoint files' bytes
    t0 = time.perf_counter()
    with progress_bar(total, what, args.quiet) as bar:
        def step(fraction):
            bar.update(int(fraction * total) - bar.n)

        done = single(args.input, args.output, step) if index is None else many(index, args.output, step)
    if not args.quiet:
        seconds = time.perf_counter() - t0
        raw, stored = (total, done["bytes"]) if what == "compress" else (done["bytes"], total)
        shard_text = f" in {done['shards']} shards" if "shards" in done else ""
        print(f"{args.input} -> {args.output}: {done['tensors']} tensors{shard_text}, {raw / 1e6:.3f} MB raw, "
              f"{stored / 1e6:.3f} MB stored, ratio {raw / max(stored, 1):.4f}, {seconds:.2f} s "
              f"({raw / max(seconds, 1e-9) / 1e6:.0f} MB/s)")
    return EXIT_OK


def run_compress(args) -> int:
    return _run(args, "compress", checkpoint.compress_file, sharded.compress_index,
                lambda index: shards(read_index(index)[0]))


def run_decompress(args) -> int:
    return _run(args, "decompress", checkpoint.decompress_file, sharded.decompress_index,
                lambda index: shards(sharded.read_compressed_index(index)[0]))


# ---- info -------------------------------------------------------------------------------------

def run_info(args) -> int:
    index = _source(args.file)
    doc = checkpoint.describe_file(args.file) if index is None else sharded.describe_index(index)
    if args.json:
        print(json.dumps(doc, indent=1))
        return EXIT_OK
    parts = doc.get("shards", [doc])
    tensors = [t for part in parts for t in part["tensors"]]
    width = min(max([len(t["name"]) for t in tensors] + [6]), 60)
    print(f"{doc.get('index', doc.get('file'))}: compressed checkpoint (layout {doc['layout']}), {len(tensors)} "
          f"tensors" + (f" in {len(parts)} shards" if "shards" in doc else ""))
    head = f"{'tensor':<{width}}  {'dtype':<7} {'shape':<16} {'raw B':>14} {'stored B':>14} {'ratio':>7}  coding"
    for part in parts:
        if "shards" in doc:
            print(f"\n{part['file']}")
        print(head)
        print("-" * len(head))
        for t in part["tensors"]:
            print(f"{t['name']:<{width}}  {t['dtype']:<7} {str(t['shape']):<16} {t['raw_bytes']:>14,} "
                  f"{t['stored_bytes']:>14,} {t['ratio']:>7.4f}  {t['coding']}")
    print(f"{'total':<{width}}  {'':<7} {'':<16} {doc['raw_bytes']:>14,} {doc['stored_bytes']:>14,} "
          f"{doc['ratio']:>7.4f}")
    return EXIT_OK


# ---- verify -----------------------------------------------------------------------------------

def run_verify(args) -> int:
    index = _source(args.file)
    if args.against is not None and not args.against.exists():
        raise CommandError(EXIT_NO_FILE, f"no such file: {args.against}")
    total = sum(p.stat().st_size for p in ([args.file] if index is None else
                                           [index.parent / s for s in shards(read_index(index)[0])]))
    with progress_bar(total, "verify", args.quiet) as bar:
        def step(fraction):
            bar.update(int(fraction * total) - bar.n)

        report = (checkpoint.verify_file(args.file, args.against, step) if index is None else
                  sharded.verify_index(index, args.against, step))
    for kind in ("corrupt", "mismatch"):
        for line in report[kind]:
            print(f"kvzip weights verify: {kind}: {line}", file=sys.stderr)
    if report["corrupt"]:
        raise CommandError(EXIT_CORRUPT, f"{len(report['corrupt'])} problem(s) in the {report['tensors']} tensors of "
                                         f"{args.file}")
    if report["mismatch"]:
        raise CommandError(EXIT_FAILED, f"{args.file} does not match {args.against} ({len(report['mismatch'])} "
                                        "difference(s))")
    if not args.quiet:
        for line in report["notes"]:
            print(f"note: {line}")
        against = f" and those of {args.against}" if args.against is not None else ""
        print(f"{args.file}: {report['tensors']} tensors verified: each decoded tensor's sha256 is the recorded "
              f"one{against}")
    return EXIT_OK
