"""Is a real-data case input-bound? Its throughput beside its synthetic (compute-only) twin's,
how long its steps waited for batches, and a verdict in plain words."""

from __future__ import annotations

from dataclasses import dataclass

from .markdown import fmt, pct, table

SLOWER = 0.95
"""Real data below this fraction of the compute-only rate is a real loss (the runs' spread is
a few percent)."""
WAITED = 0.05
"""Steps that waited for batches this share of the window or more were held back by them."""


@dataclass
class Verdict:
    input_bound: bool
    words: str


def is_real(doc: dict) -> bool:
    return (doc.get("data") or {}).get("source", "synthetic") != "synthetic"


def verdict(real_rate: float | None, synthetic_rate: float | None, wait_share: float | None,
            workers: int | None, spread: float | None = None) -> Verdict:
    """What limits a real-data case, from its rate, its twin's and its share of waiting;
    ``spread`` (the larger IQR / median of the two cases) says when the gap is only noise."""
    v = _verdict(real_rate, synthetic_rate, wait_share, workers)
    if real_rate and synthetic_rate and spread is not None:
        gap = abs(real_rate / synthetic_rate - 1)
        if gap <= spread:
            v.words += (f" (the {pct(gap)} gap is within the runs' spread, {pct(spread)}: "
                        "more runs would tell it from noise)")
    return v


def _verdict(real_rate: float | None, synthetic_rate: float | None, wait_share: float | None,
             workers: int | None) -> Verdict:
    loaders = (f"{workers} loader process{'es' if workers != 1 else ''} per rank"
               if workers else "loading in the training process (0 loader processes)")
    waited = (f"steps waited {pct(wait_share)} of the window for their batch"
              if wait_share is not None else "")
    if real_rate is None:
        return Verdict(False, "no real-data figure")
    if synthetic_rate is None:
        if wait_share is None:
            return Verdict(False, "no synthetic twin to compare with")
        bound = wait_share >= WAITED
        return Verdict(bound, f"{'input-bound' if bound else 'not input-bound'}: {waited} "
                              f"with {loaders} (no synthetic twin to compare with)")
    ratio = real_rate / synthetic_rate
    if ratio >= SLOWER:
        return Verdict(False, f"not input-bound: real data runs at {pct(ratio)} of the "
                              f"compute-only rate with {loaders}")
    if wait_share is not None and wait_share >= WAITED:
        return Verdict(True, f"input-bound: real data runs at {pct(ratio)} of the compute-only "
                             f"rate ({pct(1 - ratio)} slower); {waited} with {loaders}; more "
                             "loader processes or a faster decoder would close the gap")
    return Verdict(True, f"slower by {pct(1 - ratio)} though {waited or 'no wait was recorded'}"
                         f" with {loaders}: the pipeline costs the step outside the wait "
                         "(loader processes sharing the cores or memory bandwidth, fresh "
                         "batches missing the caches, the host-to-device copy)")


def _twin(real: dict, docs: list[dict]) -> dict | None:
    """The synthetic document of the same work and framework."""
    for d in docs:
        if (not is_real(d) and d["recipe"] == real["recipe"]
                and d.get("framework") == real.get("framework")
                and d.get("workload") == real.get("workload")):
            return d
    return None


def input_section(docs: list[dict]) -> str | None:
    """The report's section on real-data documents, or None when there are none."""
    reals = [d for d in docs if is_real(d)]
    if not reals:
        return None
    rows, sentences = [], []
    several = len({d.get("framework") for d in reals}) > 1
    for real in reals:
        twin = _twin(real, docs)
        data = real.get("data") or {}
        workers = data.get("loader_workers")
        # The overhead compares runs of one execution mode only.
        twins = {(c["world_size"], c["batch_size_per_device"], c.get("mode")): c
                 for c in (twin or {}).get("cases", [])}
        for c in real["cases"]:
            s = twins.get((c["world_size"], c["batch_size_per_device"], c.get("mode")))
            synth = s["median_samples_per_s"] if s else None
            spreads = [x.get("spread") for x in (c, s) if x and x.get("spread") is not None]
            v = verdict(c["median_samples_per_s"], synth, c.get("data_wait_share"), workers,
                        max(spreads) if spreads else None)
            rows.append([real.get("framework") or "-", c["case"],
                         str(c["batch_size_per_device"]), fmt(synth),
                         fmt(c["median_samples_per_s"]),
                         fmt(c["median_samples_per_s"] / synth, 3)
                         if synth and c["median_samples_per_s"] else "-",
                         pct(c.get("data_wait_share")), "-" if workers is None else str(workers),
                         data.get("decoder") or "-", "yes" if v.input_bound else "no"])
            who = f"{real['framework']} " if several and real.get("framework") else ""
            sentences.append(f"- {who}{c['case']} b{c['batch_size_per_device']}: {v.words}.")
        where = (f"`{data.get('prefix')}` ({data.get('layout')} layout, "
                 f"{data.get('images')} images)")
    head = ["framework", "case", "batch/device", "synthetic samples/s", "real-data samples/s",
            "real / synthetic", "window waiting", "loader processes/rank", "decoder",
            "input-bound"]
    return "\n".join([
        "## Input pipeline", "",
        f"Real data from {where} beside the same case on synthetic tensors made on the "
        "device (compute only). *Window waiting*: the share of the measured window the "
        "slowest rank spent waiting for its next batch.", "",
        table(head, rows), "", *sentences])
