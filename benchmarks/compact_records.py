"""Keep one copy of each event stream in the recorded results, and compress the large ones.

Runs recorded before the runner stopped keeping a second copy hold every worker event twice:
in the run's own ``runs/<run>/events.jsonl`` and, tagged with its case and run, in the folder's
``events.jsonl``. This removes a run's own copy where every one of its lines is in the folder's
stream (and keeps it, saying so, where any is not), then writes each folder stream larger than
``--gzip-over`` KiB as ``events.jsonl.gz``, which ``--resume`` and the GPU check read as well.
Archives (a GPU check part's ``.tar.gz``) are left as they came back from the device.

    python benchmarks/compact_records.py [ROOT] [--gzip-over 64] [--dry-run]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

TAGS = ("case", "batch", "run", "probe", "profile", "attempt")


def untagged(line: str) -> str | None:
    """A folder-stream line as its worker wrote it (the runner's tags taken off)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return json.dumps({k: v for k, v in obj.items() if k not in TAGS}, sort_keys=True)


def as_written(line: str) -> str | None:
    try:
        return json.dumps(json.loads(line), sort_keys=True)
    except json.JSONDecodeError:
        return None


def drop_run_copies(folder: Path, dry_run: bool) -> tuple[int, list[str]]:
    """(lines removed, the run copies kept and why) for one results folder."""
    stream = folder / "events.jsonl"
    held = {untagged(line) for line in stream.read_text(encoding="utf-8").splitlines()}
    removed, kept = 0, []
    for copy in sorted(folder.glob("runs/**/events.jsonl")):
        lines = copy.read_text(encoding="utf-8").splitlines()
        missing = [line for line in lines if as_written(line) not in held]
        if missing:
            kept.append(f"{copy}: {len(missing)} of {len(lines)} lines not in {stream.name}")
            continue
        removed += len(lines)
        if not dry_run:
            copy.unlink()
    return removed, kept


def compress(stream: Path, over_bytes: int, dry_run: bool) -> bool:
    if stream.stat().st_size <= over_bytes:
        return False
    if not dry_run:
        data = stream.read_bytes()
        # mtime 0: the same stream compresses to the same bytes on every machine.
        with gzip.GzipFile(stream.with_name(stream.name + ".gz"), "wb", mtime=0) as f:
            f.write(data)
        stream.unlink()
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", nargs="?", type=Path,
                   default=Path(__file__).resolve().parent / "results")
    p.add_argument("--gzip-over", type=float, default=64.0, metavar="KIB",
                   help="compress folder streams larger than this (default: 64 KiB)")
    p.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    args = p.parse_args(argv)
    removed, compressed = 0, 0
    for results_file in sorted(args.root.rglob("results.json")):
        folder = results_file.parent
        if not (folder / "events.jsonl").exists():
            continue
        lines, kept = drop_run_copies(folder, args.dry_run)
        removed += lines
        for line in kept:
            print(f"kept {line}")
        compressed += compress(folder / "events.jsonl", int(args.gzip_over * 1024),
                               args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {removed} duplicated lines; {compressed} streams compressed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
