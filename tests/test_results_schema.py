"""The published JSON Schemas (``src/trainperf/schemas/``): made from the field tables and the
worker events' dataclasses, naming every key the writers write, passing every recorded result
and event stream, and refusing a corrupted file in one line that names the field, in every
command that reads results."""

from __future__ import annotations

import copy
import gzip
import json
import shutil
import tarfile
from pathlib import Path

import jsonschema
import pytest
from referencing import Registry, Resource

from trainperf import results, results_schema
from trainperf.cli import main
from trainperf.protocol import End, Eval, Start, Step
from trainperf.run_energy import Part, RunEnergy

REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "benchmarks" / "results"
SAMPLE = RECORDS / "compare-cpu" / "torch-a"


def published(name: str) -> dict:
    return json.loads((results_schema.SCHEMA_DIR / name).read_text(encoding="utf-8"))


def registry() -> Registry:
    return Registry().with_resources(
        (s["$id"], Resource.from_contents(s))
        for s in (published(results_schema.RESULTS_FILE), published(results_schema.EVENTS_FILE)))


def recorded_results() -> list[tuple[str, dict]]:
    """Every results.json under benchmarks/results, unpacked or in a GPU part's archive."""
    found = [(str(p.relative_to(RECORDS)), json.loads(p.read_text(encoding="utf-8")))
             for p in sorted(RECORDS.rglob("results.json"))]
    for archive in sorted(RECORDS.rglob("*.tar.gz")):
        with tarfile.open(archive) as tar:
            found += [(f"{archive.name}/{m.name}", json.load(tar.extractfile(m)))
                      for m in tar.getmembers()
                      if m.isfile() and m.name.endswith("/results.json")]
    return found


def test_the_published_files_are_what_the_tables_make():
    assert results_schema.main(["--check"]) == 0, "run python -m trainperf.results_schema --write"
    for schema in (published(results_schema.RESULTS_FILE),
                   published(results_schema.EVENTS_FILE)):
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_recorded_result_passes_the_schema():
    validator = jsonschema.Draft202012Validator(published(results_schema.RESULTS_FILE))
    docs = recorded_results()
    assert len(docs) > 100  # the tree as committed: ~90 folders and the GPU parts' archives
    failing = {name: e.message for name, doc in docs for e in validator.iter_errors(doc)}
    assert not failing, failing


def test_every_recorded_event_stream_passes_the_schema():
    validator = jsonschema.Draft202012Validator(published(results_schema.EVENTS_FILE),
                                                registry=registry())
    folders = sorted({p.parent for p in RECORDS.rglob("events.jsonl*")})
    lines = [(folder, line) for folder in folders for line in results.event_lines(folder)]
    assert len(lines) > 5000
    kinds = {json.loads(line)["event"] for _, line in lines}
    assert {"runner_start", "run_start", "start", "step", "end", "run_end"} <= kinds
    failing = [(str(folder), line[:120]) for folder, line in lines
               if not validator.is_valid(json.loads(line))]
    assert not failing, failing[:3]


def test_the_event_schema_tells_a_broken_event():
    validator = jsonschema.Draft202012Validator(published(results_schema.EVENTS_FILE),
                                                registry=registry())
    good = Step(index=3, seconds=0.25, samples=64, warmup=False).to_dict()
    assert validator.is_valid(good)
    assert not validator.is_valid({**good, "index": "3"})
    assert not validator.is_valid({k: v for k, v in good.items() if k != "seconds"})
    assert not validator.is_valid({**good, "event": "stepped"})
    record = results.run_record(1, [], "failed", "gone")
    assert validator.is_valid({"event": "run_end", "t": 1.0, "case": "1n1g", "batch": 8,
                               "run": 1, "record": record})
    assert not validator.is_valid({"event": "run_end", "t": 1.0,
                                   "record": {**record, "status": "gone"}})


def written_doc() -> dict:
    """A document as the writers make it, from one run's worker events (every optional part
    a throughput run can have: losses, memory, real data's waits, a training curve)."""
    start = Start(world_size=2, global_batch=16, device="cpu", env={"device_names": ["cpu"]},
                  workload={}, settings={"mode": "eager"}, train_flops_per_sample=1e9,
                  baseline_memory_bytes=10, predicted_peak_bytes=100)
    steps = [Step(index=i, seconds=0.1, samples=16, warmup=i < 2, data_wait_s=0.01)
             for i in range(6)]
    ev = Eval(step=4, samples=64, train_s=1.0, eval_s=0.1, sets={}, accuracy=0.9, reached=True)
    end = End(samples_per_s=160.0, window_s=0.4, window_samples=64, window_steps=4,
              loss_first=2.0, loss_last=1.5, losses=[2.0, 1.5], startup_s=3.0,
              recompiles_in_window=0, peak_memory_bytes=90, data_wait_s_per_rank=[0.04, 0.05])
    run = results.run_record(1, [start, *steps, ev, end], "ok", exit_code=0)
    run["retries"] = [{"attempt": 1, "reason": "port", "error": None, "folder": "x"}]
    run["after_mode_probe"] = True  # the runner's, for a timed run
    # A GPU run's energy, as the runner reads it (run_energy).
    run.update(RunEnergy({0: Part(800.0, 4.0, ["GPU-1a7f"])}).fields(run["window_samples"]))
    run["stall_timeout_s"] = 300.0  # the runner's: the stall limit it ran under
    # A multi-node run's: a node cut off, the links' probes, and a lasting change of step time.
    run["unreachable"] = {"node": 1, "step": 5, "link_down": True, "link": "eth0: no carrier",
                          "seen_by": [0, 1]}
    run["link_probes"] = {"1": [[0, 0.008], [7, 0.9]]}
    run["nodes_lost"] = True  # failed for the lost node: a resumed plan runs it again
    run["step_change"] = {"at_step": 6, "before_s": 0.1, "after_s": 0.4, "ratio": 4.0,
                          "links": {"1": {"before_s": 0.008, "after_s": 0.9, "ratio": 112.5,
                                          "probes": [1, 1]}},
                          "probe_bytes": 1048576, "verdict": "link", "nodes": [1]}
    case = results.case_record(results.CaseKey(1, 2, 8), "fp32", [run], start,
                               head=(1000, "pfc", 0.1))
    case["breakdown"], case["mode_probe"] = {"status": "ok"}, {"chosen": "eager"}
    doc = results.document("tiny-arcface", {"backbone": "tiny"}, {"runs": 1}, {}, [case],
                           source={"format": "x"}, model="tiny", tuning={"mode": "default"})
    doc.update(framework="torch", data=None, train={"target": 0.9}, role="follower",
               mode_probe={"chosen": "eager"})
    # A joined document's (trainperf join, a multi-node job's node counts), as join.join and
    # node_sweep.collect write them.
    case["measured_in"] = "nodes-1/node-0"
    doc["joined_from"] = [{"source": "nodes-1/node-0", "nodes": [1], "host": "a",
                           "mode_probe": True}]
    doc["job"] = {"kind": "slurm", "folder": ".", "steps": [{"nodes": 1,
                                                             "devices_per_node": [2]}]}
    return doc


def test_the_tables_name_every_key_the_writers_write():
    doc = written_doc()
    case, run = doc["cases"][0], doc["cases"][0]["runs"][0]
    for obj, fields in ((doc, results_schema.DOC_FIELDS), (case, results_schema.CASE_FIELDS),
                        (run, results_schema.RUN_FIELDS)):
        declared = [f[0] for f in fields]
        assert sorted(obj) == sorted(declared), (set(obj) ^ set(declared))
    jsonschema.validate(doc, published(results_schema.RESULTS_FILE))
    # A run that failed before its first event has the required fields too.
    run_schema = {"$ref": published(results_schema.RESULTS_FILE)["$id"] + "#/$defs/run"}
    jsonschema.Draft202012Validator(run_schema, registry=registry()).validate(
        results.run_record(2, [], "timeout", "hung"))


CORRUPTIONS = [
    (lambda d: d["cases"][0].__setitem__("runs", "three"),
     "field cases[0].runs is str, not array"),
    (lambda d: d["cases"][0]["runs"][1].__setitem__("status", "weird"),
     "field cases[0].runs[1].status: 'weird' is not one of"),
    (lambda d: d["cases"][0]["runs"][0].pop("samples_per_s"),
     "field cases[0].runs[0].samples_per_s is missing"),
    (lambda d: d["cases"][0].__setitem__("median_samples_per_s", "fast"),
     "field cases[0].median_samples_per_s is str, not number or null"),
    (lambda d: d.__setitem__("env", []), "field env is list, not object"),
]


@pytest.mark.parametrize("corrupt,said", CORRUPTIONS)
def test_a_corrupted_file_is_refused_naming_the_field(corrupt, said):
    doc = results.load(SAMPLE)
    corrupt(doc)
    with pytest.raises(ValueError) as err:
        results.checked(Path("x/results.json"), doc)
    assert str(err.value) == f"x/results.json: {said}" or str(err.value).startswith(
        f"x/results.json: {said}")
    assert "\n" not in str(err.value)


def test_without_jsonschema_the_structural_check_still_refuses(monkeypatch):
    monkeypatch.setattr(results, "schema_validator", lambda: None)
    doc = results.load(SAMPLE)
    doc["cases"][0]["runs"] = "three"
    with pytest.raises(ValueError, match="case field 'runs' missing or not a list"):
        results.validate(doc)


@pytest.mark.parametrize("command", [["report", "{dir}", "--out", "{out}"],
                                     ["compare", "{dir}", "{dir}"],
                                     ["export", "{dir}", "--format", "dlperf"]])
def test_report_compare_and_export_refuse_it_in_one_line(command, tmp_path, capsys):
    folder = tmp_path / "bad"
    shutil.copytree(SAMPLE, folder)
    doc = json.loads((folder / "results.json").read_text())
    doc["cases"][0]["runs"][1]["status"] = "weird"
    (folder / "results.json").write_text(json.dumps(doc))
    argv = [a.format(dir=folder, out=tmp_path / "out") for a in command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "results.json" in err[0] and "cases[0].runs[1].status" in err[0], err


def test_compacting_keeps_one_copy_and_reads_compressed_streams(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("compact_records",
                                                  REPO / "benchmarks" / "compact_records.py")
    compact = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compact)
    folder = tmp_path / "rec"
    (folder / "runs" / "1n1g_b8_run1").mkdir(parents=True)
    (folder / "runs" / "1n1g_b8_run2").mkdir(parents=True)
    worker = [json.dumps(Step(index=i, seconds=0.1, samples=8, warmup=False).to_dict())
              for i in range(3)]
    tagged = [json.dumps({**json.loads(line), "case": "1n1g", "batch": 8, "run": 1})
              for line in worker]
    stream = [json.dumps({"event": "runner_start", "t": 0.0, "env": {}}), *tagged]
    (folder / "events.jsonl").write_text("\n".join(stream) + "\n")
    (folder / "runs" / "1n1g_b8_run1" / "events.jsonl").write_text("\n".join(worker) + "\n")
    stray = json.dumps(Step(index=9, seconds=0.1, samples=8, warmup=False).to_dict())
    (folder / "runs" / "1n1g_b8_run2" / "events.jsonl").write_text(stray + "\n")
    (folder / "results.json").write_text("{}")
    assert compact.main([str(tmp_path), "--gzip-over", "0"]) == 0
    assert not (folder / "runs" / "1n1g_b8_run1" / "events.jsonl").exists()
    assert (folder / "runs" / "1n1g_b8_run2" / "events.jsonl").exists()  # not held: kept
    assert not (folder / "events.jsonl").exists()
    with gzip.open(folder / "events.jsonl.gz", "rt") as f:
        assert f.read().splitlines() == stream
    assert results.has_events(folder) and results.event_lines(folder) == stream
    results.uncompress_events(folder)  # as --resume does before it appends
    assert (folder / "events.jsonl").read_text().splitlines() == stream
    assert not (folder / "events.jsonl.gz").exists()


def test_a_corrupt_doc_is_not_changed_by_checking():
    doc = results.load(SAMPLE)
    before = copy.deepcopy(doc)
    results.checked(Path("x"), doc)
    assert doc == before
