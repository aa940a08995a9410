"""``padless inspect PATH``: how much padding a dataset carries, and what padless saves.

    padless inspect data/shard-{000..009}.tar --batch-size 32
    padless inspect images/ --budget 2000000 --plot occupancy.png
    padless inspect tokenized/ --field input_ids --attention --json
    padless inspect lengths.txt --pairs --triangle --budget 200000

It reads the sizes (see :mod:`padless.cli.sources`), forms one epoch of batches with
padless' random, bucketed and budget samplers, and prints for each the steps per epoch,
the occupancy of the padded batches and the work padless saves against them (see
:mod:`padless.cli.report`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

import numpy as np

from padless.cli.sources import ACCEPTED, FORMATS, InspectError, SizeTable, read_sizes

EPILOG = f"PATH is one of: {ACCEPTED}."


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "inspect",
        help="report a dataset's sizes, its padding under random, bucketed and budget batching, and what padless saves",
        description="Report a dataset's sample sizes, its padding under random, bucketed and budget batching, and the work padless saves.",
        epilog=EPILOG,
    )
    p.add_argument("path", metavar="PATH", help="shards, an image folder, a saved HF dataset or a file of lengths")
    p.add_argument("--format", choices=FORMATS, help="skip format detection")
    p.add_argument("--batch-size", type=_positive_int, metavar="B", help="samples per batch (random, bucket); default 32")
    p.add_argument("--budget", type=_positive_float, metavar="T", help="elements per batch (budget): tokens, pixels or N^2 cells")
    p.add_argument("--buckets", type=_positive_int, default=8, help="length buckets of the bucketed strategy (default 8)")
    p.add_argument("--seed", type=int, default=0, help="the samplers' seed (epoch 0)")
    p.add_argument("--pairs", action="store_true", help="lengths are N of N x N pair states (N^2 cells per sample)")
    p.add_argument("--attention", action="store_true", help="also price attention: sum L_i^2 vs B * max L^2 (pairs: N^3)")
    p.add_argument("--triangle", action="store_true", help="pairs: also price N^3 triangle ops")
    p.add_argument("--patch-size", type=_positive_int, metavar="P", help="images: count P x P patches, not pixels")
    p.add_argument("--field", help="shards: the member extension(s) to size ('jpg;png', 'npy'); HF: the list or Image column")
    p.add_argument("--length-column", help="HF, csv, json: the column holding each sample's length ('height,width' for csv)")
    p.add_argument("--split", help="HF DatasetDict: the split (default: train, or the only one)")
    p.add_argument("--plot", metavar="FILE", help="draw the size distribution and the occupancy per batch (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--progress", action="store_true", help="show scanning progress on stderr even when it is not a terminal")
    p.set_defaults(run=run)
    return p


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {s}")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {s}")
    return v


class Progress:
    """``\\r``-updated ``label done/total`` on ``stream``, at most ten times a second; a newline at the end."""

    def __init__(self, label: str, stream: TextIO) -> None:
        self.label, self.stream, self.last, self.shown = label, stream, 0.0, False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last, self.shown = now, True
        self.stream.write(f"\r{self.label} {done:,}/{total:,}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def sizes_for(table: SizeTable, *, pairs: bool, patch_size: int | None) -> tuple[np.ndarray, str]:
    """The extents batches are padded over, and the kind of data: tokens, images or pairs."""
    sizes = table.sizes
    k = sizes.shape[1]
    if k == 2:
        if pairs:
            raise InspectError(f"padless inspect: --pairs takes one N per sample; {table.source!r} gives H x W sizes")
        if patch_size:
            sizes = -(-sizes // patch_size)
        return sizes, "images"
    if patch_size:
        raise InspectError(f"padless inspect: --patch-size applies to images; {table.source!r} gives one length per sample")
    return sizes, "pairs" if pairs else "tokens"


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Read, batch, report (the ``inspect`` subcommand); returns the exit status."""
    from padless.cli.report import build_report, to_dict, to_text

    out = out or sys.stdout
    err = err or sys.stderr

    show = args.progress or err.isatty()
    table = read_sizes(
        args.path, format=args.format, field=args.field, length_column=args.length_column, split=args.split,
        progress=Progress("padless inspect: scanning", err) if show else None,
    )
    if len(table.sizes) == 0:
        raise InspectError(f"padless inspect: no readable sample in {args.path!r}" + (f" ({table.skipped[0]})" if table.skipped else ""))
    sizes, kind = sizes_for(table, pairs=args.pairs, patch_size=args.patch_size)
    if args.triangle and kind != "pairs":
        raise InspectError("padless inspect: --triangle prices the N^3 triangle ops of pair data; add --pairs")
    report = build_report(
        sizes, kind=kind, batch_size=args.batch_size, budget=args.budget, seed=args.seed, num_buckets=args.buckets,
        attention=args.attention, triangle=args.triangle, patch_size=args.patch_size if kind == "images" else None,
    )
    report.source = {
        "path": table.source, "format": table.format, "detail": table.detail, "skipped": table.skipped,
        "patch_size": args.patch_size,
    }
    if args.plot:
        from padless.cli.plot import write_plot

        write_plot(report, args.plot)
    if args.json:
        doc = to_dict(report)
        if args.plot:
            doc["plot"] = args.plot
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        out.write(to_text(report) + "\n")
        if args.plot:
            out.write(f"plot: {args.plot}\n")
    return 0

