"""A loader process of the framework-neutral feed (``feed.LoaderFeed``): it reads, decodes and
augments its share of one rank's batches and writes each into a slot of memory it shares with
the worker.

Started by the worker with trainperf's own interpreter (the one with the decoders), never a
framework's. It talks over its standard streams, a line at a time:

- it says ``ready DECODER`` once its dataset is open;
- the worker names a free slot (``SLOT``); the loader fills it with its next batch and answers
  ``SLOT``; an empty line or the end of its input ends it;
- on a failure it says ``error MESSAGE`` (one line) and leaves with status 1.

A slot holds a batch's uint8 NHWC images, then its int64 labels, then its (epoch, sample)
pairs as int64 (``slot_layout``). Loader ``k`` of ``n`` fills the rank's batches ``k``,
``k + n``, ``k + 2n``... of the stream ``stream.RankSampler`` gives, so the worker reads the
same batches in the same order whatever the number of loaders.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import sys

from .shared_batches import slot_views


def batches(sampler, batch_size: int, loader: int, loaders: int):
    """This loader's batches of the stream: lists of (epoch, sample) pairs."""
    stream = iter(sampler)
    for number in itertools.count():
        batch = list(itertools.islice(stream, batch_size))
        if number % loaders == loader:
            yield batch


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def serve(job: dict) -> None:
    from .layout import open_dataset
    from .stream import RankSampler, SampleReader

    dataset = open_dataset(job["prefix"])
    reader = SampleReader(dataset, job["decoder"], job["task"], job["size"],
                          job["num_classes"], job["seed"])
    sampler = RankSampler(len(dataset), job["rank"], job["world"], job["seed"],
                          start=job["start"])
    batch_size, size = job["batch_size"], job["size"]
    buffer = mmap.mmap(job["fd"], 0)
    own = batches(sampler, batch_size, job["loader"], job["loaders"])
    say(f"ready {reader.decoder_name}")
    for line in sys.stdin:
        if not line.strip():
            break
        slot = int(line)
        images, labels, pairs = slot_views(buffer, slot, batch_size, size)
        for i, (epoch, index) in enumerate(next(own)):
            images[i], labels[i] = reader.read(epoch, index)
            pairs[i] = epoch, index
        say(str(slot))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", help="JSON: the dataset, the rank's stream, this loader's share")
    job = json.loads(parser.parse_args(argv).job)
    try:
        serve(job)
    except (BrokenPipeError, KeyboardInterrupt):
        return 0  # the worker has gone: nothing is waiting for this loader's batches
    except Exception as exc:  # noqa: BLE001 - the worker gets every failure as one line
        text = " ".join(f"{exc}".split())
        # A file's own errors name the file; anything else also says what it was.
        message = text if isinstance(exc, (ValueError, OSError)) and text else \
            f"{type(exc).__name__}: {text}"
        try:
            say(f"error {message}")
        except BrokenPipeError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
