"""Real data (part 4): real data on the device against its synthetic twin, for the
input-bound verdict.

``data synth`` writes a face set; the same case then runs on it through the input pipeline and
on synthetic tensors, the runs taking turns (``run --data``'s way), with DALI's ``mixed``
decoder (nvJPEG on the GPU) as a third contender where DALI is installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

from ..config import DataSpec, Measure
from ..data import dali_feed
from ..data.decode import available as decoders_available
from ..data.layout import open_dataset
from ..data.synth import synthesize
from ..progress import QuietProgress
from ..report.input import verdict
from ..runner import Runner, interleave
from . import cases
from .record import StageLog
from .runs import plan_for, summarise

SYNTH = {"gpu": {"identities": 200, "images_per_identity": 10, "size": 112},
         "cpu": {"identities": 20, "images_per_identity": 4, "size": 32}}
CASE = {"gpu": cases.Case("R100 emore dp fp32", "r100-arcface-emore", {}),
        "cpu": cases.Case("tiny dp fp32 32px", "tiny-arcface", {"input_size": 32})}
MEASURE = {"gpu": Measure(runs=2, iters=40, warmup=10, timeout_s=120),
           "cpu": Measure(runs=1, iters=10, warmup=3, timeout_s=60)}


def run(log: StageLog, mode: str, work: Path) -> None:
    if importlib.util.find_spec("PIL") is None:
        log.not_run("real data against synthetic", "`data synth` writes its JPEGs with Pillow, "
                                                   "which is not installed")
        return
    if not decoders_available():
        log.not_run("real data against synthetic", "no JPEG decoder is installed (simplejpeg, "
                                                   "OpenCV or Pillow)")
        return
    made = synthesize(work / "data" / "faces", seed=0, **SYNTH[mode])
    log.add("dataset", **{k: made[k] for k in ("prefix", "images", "identities", "bytes",
                                               "seconds")})
    dataset = open_dataset(made["prefix"])
    case = CASE[mode]
    device = cases.device(mode)
    synthetic = plan_for(case, work, MEASURE[mode], device, folder="data-synthetic")
    synthetic = replace(synthetic, data_role="synthetic baseline")
    dataset.check_classes(synthetic.workload.num_classes)
    decoders = ["auto"]
    if dali_feed.available():
        decoders.append("dali")
    else:
        log.not_run("DALI mixed decoder", "DALI is not installed")
    reals = [plan_for(case, work, MEASURE[mode], device, folder=f"data-real-{name}",
                      data=DataSpec(made["prefix"], name)) for name in decoders]
    runners = [Runner(p, QuietProgress()) for p in (synthetic, *reals)]
    docs = interleave(runners, [False] * len(runners))
    twin = summarise(docs[0], synthetic.out_dir)
    for plan, doc in zip(reals, docs[1:]):
        got = summarise(doc, plan.out_dir)
        c = doc["cases"][0] if doc.get("cases") else {}
        data = doc.get("data") or {}
        spreads = [x for x in (got.get("spread"), twin.get("spread")) if x is not None]
        v = verdict(got.get("median_samples_per_s"), twin.get("median_samples_per_s"),
                    c.get("data_wait_share"), data.get("loader_workers"),
                    max(spreads) if spreads else None)
        log.add("realdata", label=case.label, decoder=data.get("decoder") or plan.data.decoder,
                asked=plan.data.decoder, loader_workers=data.get("loader_workers"),
                real_samples_per_s=got.get("median_samples_per_s"),
                synthetic_samples_per_s=twin.get("median_samples_per_s"),
                data_wait_share=c.get("data_wait_share"), input_bound=v.input_bound,
                verdict=v.words, real=got, synthetic=twin)
        print(f"real data ({plan.data.decoder}): {v.words}", flush=True)
