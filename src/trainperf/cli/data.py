"""`trainperf data`: pack an image folder into RecordIO, write a synthetic face set, measure
the loader."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import parse_int_list
from .common import EXIT_OK


def register(sub) -> None:
    data = sub.add_parser("data", help="RecordIO datasets: pack, synthesize, measure the loader")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    pack = data_sub.add_parser("pack", help="pack an image folder into PREFIX.rec/.idx")
    pack.add_argument("image_dir", help="one sub-folder per identity (or class)")
    pack.add_argument("--out", required=True, metavar="PREFIX")
    pack.add_argument("--layout", choices=["face", "flat"], default="face",
                      help="face: insightface's (header, images, identity records); flat: "
                           "im2rec's, one record per image (ImageNet)")
    pack.set_defaults(handler=cmd_pack)
    synth = data_sub.add_parser("synth", help="write a synthetic face-like dataset")
    synth.add_argument("--identities", type=int, required=True)
    synth.add_argument("--images-per-identity", type=int, required=True)
    synth.add_argument("--size", type=int, default=112, help="image side (default 112)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--val-pairs", type=int, default=600, metavar="N",
                       help="also write PREFIX.val.bin, N verification pairs (half of them "
                            "same-identity) of identities not in the training set, in "
                            "insightface's .bin format (default 600, a tenth of lfw.bin's "
                            "6000 and quick to write; 0: none)")
    synth.add_argument("--out", required=True, metavar="PREFIX")
    synth.set_defaults(handler=cmd_synth)
    bench = data_sub.add_parser("bench", help="decoded images/s of the loader per worker count")
    bench.add_argument("prefix")
    bench.add_argument("--workers", default="1,2,4", help="loader processes; a list sweeps")
    bench.add_argument("--decoder", default="auto",
                       help="a decoder, a list, or all (default: the fastest installed)")
    bench.add_argument("--recipe", default="r100-arcface-emore",
                       help="whose augmentation and batch size to use (default "
                            "r100-arcface-emore)")
    bench.add_argument("--batch-size", type=int)
    bench.add_argument("--batches", type=int, default=50, help="batches measured per setting")
    bench.add_argument("--warmup", type=int, default=5, help="batches not measured")
    bench.add_argument("--out", help="folder for data_bench.json")
    bench.set_defaults(handler=cmd_bench)


def cmd_pack(args: argparse.Namespace) -> int:
    from ..data.pack import pack_folder

    done = pack_folder(args.image_dir, args.out, layout=args.layout)
    print(f"packed {done['images']} images of {done['classes']} classes into "
          f"{done['prefix']}.rec ({done['bytes'] / 2**20:.1f} MiB, {args.layout} layout)")
    return EXIT_OK


def cmd_synth(args: argparse.Namespace) -> int:
    from ..data.synth import synthesize

    done = synthesize(args.out, args.identities, args.images_per_identity, size=args.size,
                      seed=args.seed, val_pairs=args.val_pairs)
    print(f"wrote {done['images']} images of {done['identities']} identities to "
          f"{done['prefix']}.rec ({done['bytes'] / 2**20:.1f} MiB)")
    if done["val_bin"]:
        print(f"wrote {done['val_pairs']} verification pairs of held-out identities to "
              f"{done['val_bin']}")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..data import bench
    from ..data.layout import open_dataset
    from ..env import host_env
    from ..recipes import get_recipe
    from ..results import write_json_atomic

    workload = get_recipe(args.recipe).workload
    batch = args.batch_size or workload.batch_size
    workers = parse_int_list(args.workers, "--workers")
    decoders = bench.decoders_of(args.decoder)
    dataset = open_dataset(args.prefix)

    def show(fig) -> None:
        print(f"{fig.decoder} x{fig.workers}: {fig.images_per_s:.0f} images/s", file=sys.stderr,
              flush=True)

    figures = bench.sweep(dataset, decoders, workers, task=workload.task,
                          size=workload.input_size, batch_size=batch, batches=args.batches,
                          warmup=args.warmup, on_figure=show)
    tbl = Table(title=f"loader images/s: {args.prefix} ({workload.task} augmentation, "
                      f"{workload.input_size}px, batch {batch})")
    for col in ("decoder", "workers", "images/s", "per worker"):
        tbl.add_column(col, no_wrap=True)
    for f in figures:
        tbl.add_row(f.decoder, str(f.workers), f"{f.images_per_s:.0f}",
                    f"{f.images_per_s_per_worker:.0f}")
    Console().print(tbl)
    if args.out:
        doc = bench.document(dataset, args.recipe, workload.task, workload.input_size, batch,
                             args.batches, args.warmup, host_env(), figures)
        path = Path(args.out) / "data_bench.json"
        write_json_atomic(path, doc)
        print(f"data bench: {path}")
    return EXIT_OK
