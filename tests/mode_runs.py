"""What the frameworks' mode tests share: tiny-arcface with the sharded head (``mp``: its
collectives run on 2 ranks) on 1 and 2 CPU ranks in one execution mode, and the records and
``start`` events it left."""

from __future__ import annotations

import json
import math
from pathlib import Path

from trainperf import results
from trainperf.config import Measure, Topology, Tuning
from trainperf.protocol import End, Event, Start, Step
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan, Runner

RANKS = (1, 2)


def run_in(framework: str, mode: str, out: Path, iters: int, warmup: int) -> dict:
    """``framework``'s run in ``mode`` (``default`` too): ``iters`` steps, ``warmup`` of them
    before the window, on each rank count; the results document."""
    recipe = get_recipe("tiny-arcface")
    plan = Plan(recipe.name, recipe.workload.replace(fc="mp"),
                Measure(runs=1, iters=iters, warmup=warmup),
                [Case(Topology(devices_per_node=d, device="cpu"), 8) for d in RANKS], out,
                tuning=Tuning(mode=mode), framework=framework)
    Runner(plan).run()
    return results.load(out)


def records(doc: dict) -> list[dict]:
    """The one run of each case, 1 rank then 2."""
    assert [c["world_size"] for c in doc["cases"]] == list(RANKS)
    return [c["runs"][0] for c in doc["cases"]]


def starts(out: Path) -> list[dict]:
    """The ``start`` events of every run in ``out``."""
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()
            if '"event": "start"' in line]


def assert_learned_in(run: dict, mode: str, steps: int) -> None:
    """One run of ``run_in``: measured, in ``mode``, its ``steps`` losses finite and falling (one
    batch again and again: it learns), and its first step timed."""
    assert run["status"] == "ok" and run["samples_per_s"] > 0, run["error"]
    assert run["mode"] == mode
    losses = run["losses"]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert run["first_step_s"] > 0


def stand_in_events(mode: str, rate: float, world: int, batch: int,
                    measure: Measure) -> list[Event]:
    """The events of a run in ``mode`` at a known rate (samples/s), as rank 0 writes them: its
    compile count moves in step 0 only."""
    global_batch = batch * world
    return [Start(world_size=world, global_batch=global_batch, device="cpu", env={},
                  workload={}, settings={"mode": mode}),
            *[Step(index=i, seconds=global_batch / rate, samples=global_batch,
                   warmup=i < measure.warmup, compiles=1) for i in range(measure.iters)],
            End(samples_per_s=rate, window_s=measure.window_steps * global_batch / rate,
                window_samples=measure.window_steps * global_batch,
                window_steps=measure.window_steps, loss_first=1.0, loss_last=0.9)]


def step_compiles(out: Path) -> dict[str, list]:
    """Each case's ``compiles`` from its timed runs' ``step`` events (a probe round's and a
    profiled run's are not read), in step order; a launch started again writes no step twice:
    keyed by index all the same."""
    seen: dict[str, dict[int, int | None]] = {}
    for line in results.event_lines(out):
        event = json.loads(line)
        if event.get("event") == "step" and not event.get("profile") and not event.get("probe"):
            seen.setdefault(event["case"], {})[event["index"]] = event["compiles"]
    return {case: [by_index[i] for i in sorted(by_index)] for case, by_index in seen.items()}
