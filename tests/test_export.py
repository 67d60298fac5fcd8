"""`trainperf export` as a table and `trainperf.export.frame()`: every recorded result
(archives included) round-trips through CSV, Parquet and the DataFrame with the declared
columns and types; a row per case; several folders as one table; a bad file stops the export in
one line; the docs page shows the declared columns."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import log_fixtures as fx
from trainperf import export
from trainperf.cli import main
from trainperf.ingest import ingest_logdir

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# A GPU run with channels-last images: a known row with a device name and a true boolean.
KNOWN = RESULTS / "gpu-h200-2026-11-26" / "layout" / "r100-bf16-cl" / "results.json"
SMALL = RESULTS / "framework_compare-cpu" / "tiny-arcface-dp" / "torch" / "results.json"
ARROW = {"string": pa.string(), "Int64": pa.int64(), "Float64": pa.float64(),
         "boolean": pa.bool_()}


def recorded_documents() -> dict[str, dict]:
    """Every results.json under benchmarks/results by its source name, read by a walk of its
    own (unpacked files, then each archive's members) rather than by the export's reader; a
    follower node's records (exits, no figures) and a job's node folders (whose figures the
    job's documents hold) left out, as the export leaves them out."""
    jobs = [p.parent for p in RESULTS.rglob("job.json")]
    docs = {}
    for path in sorted(RESULTS.rglob("results.json")):
        if any(j in path.parents and re.fullmatch(r"nodes?-\d+", path.relative_to(j).parts[0])
               for j in jobs):
            continue
        docs[str(path)] = json.loads(path.read_text(encoding="utf-8"))
    for archive in sorted(RESULTS.rglob("*.tar.gz")):
        with tarfile.open(archive) as tar:
            for member in tar:
                if member.isfile() and Path(member.name).name == "results.json":
                    docs[f"{archive}/{member.name}"] = json.load(tar.extractfile(member))
    return {k: d for k, d in docs.items() if d.get("role") != "follower"}


def test_a_followers_records_and_a_jobs_node_folders_are_left_out(tmp_path):
    """A job's documents hold its figures once; its node folders hold them again (the
    leader's) or not at all (a follower's exits)."""
    shutil.copytree(SMALL.parent, tmp_path / "job" / "node-0")
    follower = json.loads(SMALL.read_text())
    follower["role"] = "follower"
    (tmp_path / "job" / "node-1").mkdir()
    (tmp_path / "job" / "node-1" / "results.json").write_text(json.dumps(follower))
    assert len(export.documents(tmp_path)) == 1  # no job.json: the leader's is the only one
    shutil.copy(SMALL, tmp_path / "job" / "results.json")
    (tmp_path / "job" / "job.json").write_text(json.dumps({"documents": ["results.json"]}))
    assert [s for s, _ in export.documents(tmp_path)] == [str(tmp_path / "job" /
                                                              "results.json")]


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict]:
    return recorded_documents()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """The whole recorded tree exported by the command, at run level, as CSV and Parquet."""
    folder = tmp_path_factory.mktemp("export")
    out = {"csv": folder / "runs.csv", "parquet": folder / "runs.parquet"}
    for fmt, path in out.items():
        assert main(["export", str(RESULTS), "--format", fmt, "--out", str(path)]) == 0
    return out


@pytest.fixture(scope="module")
def run_frame() -> pd.DataFrame:
    return export.frame(RESULTS)


def names(level: str) -> list[str]:
    return [c.name for c in export.columns(level)]


def total_runs(docs) -> int:
    return sum(len(c["runs"]) for d in docs for c in d["cases"])


def test_the_recorded_tree_round_trips_through_csv(recorded, exported):
    assert len(recorded) > 90 and any(".tar.gz/" in s for s in recorded)
    with exported["csv"].open(newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == names("run")
    assert len(table) == total_runs(recorded.values())
    assert {r["source"] for r in table} == {s for s, d in recorded.items() if total_runs([d])}
    doc = recorded[str(KNOWN)]
    mine = [r for r in table if r["source"] == str(KNOWN)]
    case, run = doc["cases"][0], doc["cases"][0]["runs"][0]
    assert (mine[0]["case"], mine[0]["run"]) == (case["case"], str(run["run"]))
    assert float(mine[0]["samples_per_s"]) == run["samples_per_s"]
    assert (mine[0]["framework"], mine[0]["precision"]) == (doc["framework"], "bf16")
    assert (mine[0]["device_name"], mine[0]["channels_last"]) == ("NVIDIA H200", "true")
    assert mine[0]["mode"] == ""  # recorded before modes: empty, not a failure
    # A run that ran out of memory: no speed, its error kept.
    oom = next(r for r in table if r["status"] == "oom")
    assert oom["samples_per_s"] == "" and oom["error"]


def test_the_recorded_tree_round_trips_through_parquet(recorded, exported):
    table = pq.read_table(exported["parquet"])
    assert table.schema.names == names("run")
    assert [table.schema.field(c.name).type for c in export.columns("run")] == [
        ARROW[c.type] for c in export.columns("run")]
    assert table.num_rows == total_runs(recorded.values())
    rows = table.to_pylist()
    archived = next(r for r in rows if ".tar.gz/" in r["source"])
    doc = recorded[archived["source"]]
    case = next(c for c in doc["cases"] if c["case"] == archived["case"])
    run = next(r for r in case["runs"] if r["run"] == archived["run"])
    assert archived["samples_per_s"] == run["samples_per_s"]
    assert archived["framework"] == doc["framework"]
    assert archived["speedup"] == case["speedup"]
    assert archived["samples_per_s_per_device"] == pytest.approx(
        run["samples_per_s"] / case["world_size"])


def test_the_frame_has_the_declared_nullable_dtypes(recorded, run_frame):
    assert list(run_frame.columns) == names("run")
    assert len(run_frame) == total_runs(recorded.values())
    for c in export.columns("run"):
        assert run_frame[c.name].dtype == pd.api.types.pandas_dtype(c.type), c.name
    # Records from before modes were named have none; those since say theirs.
    assert run_frame["mode"].isna().any() and run_frame["samples_per_s"].isna().any()
    named = run_frame[run_frame["mode"].notna()]
    assert len(named) and all(isinstance(m, str) and m for m in named["mode"])
    known = run_frame[run_frame["source"] == str(KNOWN)].iloc[0]
    assert known["samples_per_s"] == recorded[str(KNOWN)]["cases"][0]["runs"][0]["samples_per_s"]
    assert bool(known["channels_last"]) is True


def test_a_row_per_case(tmp_path, recorded):
    out = tmp_path / "cases.jsonl"
    assert main(["export", str(RESULTS / "framework_compare-cpu"), str(KNOWN), "--format",
                 "jsonl", "--level", "case", "--out", str(out)]) == 0
    table = [json.loads(line) for line in out.read_text().splitlines()]
    docs = [d for s, d in recorded.items()
            if s.startswith(str(RESULTS / "framework_compare-cpu")) or s == str(KNOWN)]
    assert len(table) == sum(len(d["cases"]) for d in docs)
    assert all(list(row) == names("case") for row in table)
    last = table[-1]
    assert last["source"] == str(KNOWN) and "run" not in last
    case = recorded[str(KNOWN)]["cases"][-1]
    assert last["median_samples_per_s"] == case["median_samples_per_s"]
    assert last["runs"] == len(case["runs"]) and last["ok_runs"] == case["ok_runs"]
    assert last["startup_s"] is None  # not recorded then: null in JSON Lines


def test_several_dirs_make_one_table(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b" / "deeper"
    for folder in (first, second):
        folder.mkdir(parents=True)
        shutil.copy(SMALL, folder / "results.json")
    out = tmp_path / "both.csv"
    assert main(["export", str(first), str(tmp_path / "b"), "--format", "csv",
                 "--out", str(out)]) == 0
    with out.open(newline="") as f:
        table = list(csv.DictReader(f))
    one = len(export.rows(SMALL))
    assert len(table) == 2 * one
    assert [r["source"] for r in table] == (
        [str(first / "results.json")] * one + [str(second / "results.json")] * one)
    # A tree and a folder inside it: each file once.
    assert len(export.rows([tmp_path, second, second / "results.json"])) == 2 * one


def test_jsonl_writes_what_json_cannot_hold_as_null(tmp_path):
    doc = json.loads(SMALL.read_text())
    doc["cases"][0]["memory_model_error"] = float("nan")
    (tmp_path / "results.json").write_text(json.dumps(doc))
    buffer = io.StringIO()
    export.write_jsonl(export.rows(tmp_path, "case"), buffer)
    # Python's json reads NaN; a strict reader does not, so neither may the file hold it.
    first = json.loads(buffer.getvalue().splitlines()[0],
                       parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert first["memory_model_error"] is None


def test_ingested_logs_export_too(tmp_path):
    logs = tmp_path / "logs"
    for run, value in enumerate((233.9, 234.5), start=1):
        fx.write_run(logs, 64, "1n1g", "r100", "fp32", run,
                     fx.speedometer(fx.speeds_with_mean(value)))
    ingest_logdir(logs, "mxnet-speedometer", "exact").write(tmp_path / "ingested")
    table = export.rows(tmp_path / "ingested")
    assert [(r["framework"], r["model"], r["run"]) for r in table] == [
        ("mxnet", "r100", 1), ("mxnet", "r100", 2)]
    assert table[0]["device_type"] is None and table[0]["samples_per_s"] > 0


def corrupt_runs(doc: dict) -> None:
    doc["cases"][0]["runs"] = "3 runs"


def corrupt_status(doc: dict) -> None:
    doc["cases"][0]["runs"][0]["status"] = "weird"


@pytest.mark.parametrize("corrupt, field", [(corrupt_runs, "runs"), (corrupt_status, "status")])
def test_a_corrupted_results_file_is_one_line_naming_it(tmp_path, capsys, corrupt, field):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for folder in (good, bad):
        folder.mkdir()
        shutil.copy(SMALL, folder / "results.json")
    doc = json.loads(SMALL.read_text())
    corrupt(doc)
    (bad / "results.json").write_text(json.dumps(doc))
    out = tmp_path / "t.csv"
    assert main(["export", str(tmp_path), "--format", "csv", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(bad / "results.json") in err and field in err
    assert not out.exists()


def test_parquet_needs_out_and_dlperf_one_dir(tmp_path, capsys):
    assert main(["export", str(SMALL), "--format", "parquet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out" in err
    assert main(["export", str(SMALL), str(SMALL), "--format", "dlperf"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["export", str(tmp_path), "--format", "csv"]) == 2
    assert capsys.readouterr().err.strip() == f"trainperf: error: no results.json under {tmp_path}"


def test_parquet_without_pyarrow_is_one_line(tmp_path, capsys, monkeypatch):
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as when not installed
    assert main(["export", str(SMALL), "--format", "parquet", "--out",
                 str(tmp_path / "t.parquet")]) == 2
    assert capsys.readouterr().err.strip() == (
        "trainperf: error: parquet needs pyarrow: pip install 'trainperf[table]'")


def test_csv_and_jsonl_load_neither_pandas_nor_pyarrow():
    code = ("import io, sys, contextlib; from trainperf import export; "
            "buf = io.StringIO(); f = contextlib.redirect_stdout(buf); f.__enter__(); "
            f"export.export([{str(SMALL)!r}], 'csv'); export.export([{str(SMALL)!r}], 'jsonl'); "
            "f.__exit__(None, None, None); "
            "print(sorted(m for m in ('pandas', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_stdout_holds_the_data_only(capsys):
    assert main(["export", str(SMALL), "--format", "csv"]) == 0
    got = capsys.readouterr()
    table = list(csv.DictReader(got.out.splitlines()))
    assert len(table) == len(export.rows(SMALL)) and got.err == ""


def test_columns_are_declared_once_with_known_types():
    assert len({c.name for c in export.COLUMNS}) == len(export.COLUMNS)
    assert {c.type for c in export.COLUMNS} <= set(export.TYPES)
    assert all(set(c.levels) <= set(export.LEVELS) and c.description for c in export.COLUMNS)
