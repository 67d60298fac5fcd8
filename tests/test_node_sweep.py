"""From one device to N nodes in one document: results measured apart joined (`trainperf
join`, ``trainperf.join``), a folder's plan documents found as a command wrote them
(``result_files.plan_documents``), and a node sweep on emulated nodes (`trainperf emulate
--cases`) whose every node count runs in the mode its first case's probe chose."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainperf import join, results
from trainperf.cli import main
from trainperf.emulated_nodes import missing_privilege
from trainperf.result_files import plan_documents

TINY = ["--device", "cpu", "--runs", "1", "--iters", "4", "--warmup", "1"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, Path]:
    """Real tiny runs measured apart: one device, two devices, two devices in bf16, and a
    folder of two plans (the dp and mp heads, as `run --fc dp,mp` writes them)."""
    where = tmp_path_factory.mktemp("apart")
    runs = {"one": ["--devices", "1"], "two": ["--devices", "2"],
            "two-bf16": ["--devices", "2", "--precision", "bf16"],
            "plans": ["--devices", "1", "--fc", "dp,mp"]}
    for name, argv in runs.items():
        assert main(["run", "tiny-arcface", *TINY, *argv, "--out", str(where / name)]) == 0
    return {name: where / name for name in runs}


def load(folder: Path) -> tuple[str, dict]:
    return str(folder), results.load(folder)


def test_documents_measured_apart_join_with_speedups_against_the_whole(measured):
    doc = join.join([load(measured["two"]), load(measured["one"])])
    assert [c["case"] for c in doc["cases"]] == ["1n1g", "1n2g"]
    one, two = doc["cases"]
    assert one["speedup"] == 1.0 and one["measured_in"] == str(measured["one"])
    assert two["speedup"] == pytest.approx(two["median_samples_per_s"]
                                           / one["median_samples_per_s"])
    assert two["scaling_efficiency"] == pytest.approx(two["speedup"] / 2)
    # Its parts alone had no 1-device case for the 2-device one.
    assert results.load(measured["two"])["cases"][0]["speedup"] is None
    # The environment is the base's, the one that measured the fewest nodes and devices.
    assert doc["joined_from"][0]["source"] == str(measured["one"])
    results.validate(doc)


@pytest.mark.parametrize("other,needle", [
    ("two-bf16", "precision (fp32 / bf16)"),
    ("one", "both hold case 1n1g b8"),
])
def test_a_pair_that_measured_different_things_is_refused(measured, other, needle):
    with pytest.raises(ValueError, match=rf"cannot join .*{other}.* to .*one.*{needle}"
                       .replace("(", r"\(").replace(")", r"\)")):
        join.join([load(measured["one"]), load(measured[other])])


def test_a_pair_timed_in_two_modes_is_refused(measured):
    """The mode is what ran (each case records it): a document whose cases ran in another
    mode measured another step."""
    where, doc = load(measured["two"])
    other = json.loads(json.dumps(doc))
    for case in other["cases"]:
        case["mode"] = "compile"
    with pytest.raises(ValueError, match=r"mode \(eager / compile\)"):
        join.join([load(measured["one"]), (where, other)])
    follower = {**doc, "role": "follower"}
    with pytest.raises(ValueError, match="follower"):
        join.join([load(measured["one"]), (where, follower)])


def test_join_writes_each_plan_and_a_report_of_the_whole(measured, tmp_path, capsys):
    out = tmp_path / "joined"
    assert main(["join", str(measured["one"]), str(measured["two"]), "--out", str(out)]) == 0
    capsys.readouterr()
    (doc,) = [results.load(p) for p in plan_documents(out)]
    assert [(c["case"], c["speedup"] is not None) for c in doc["cases"]] == \
        [("1n1g", True), ("1n2g", True)]
    assert "Measured in 2 parts, joined" in (out / "report.md").read_text()
    # Every follow-up reads the joined folder as a run's own.
    assert main(["export", str(out), "--format", "csv", "--level", "case",
                 "--out", str(tmp_path / "cases.csv")]) == 0
    assert len((tmp_path / "cases.csv").read_text().splitlines()) == 1 + 2
    capsys.readouterr()
    assert main(["join", str(measured["one"]), str(measured["two-bf16"]),
                 "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainperf: error: cannot join") and "precision" in err \
        and "\n" not in err
    assert not (tmp_path / "refused").exists()  # nothing written


def test_a_folder_holds_its_plans_as_the_command_wrote_them(measured, tmp_path):
    """One plan's folder; several frameworks' sub-folders; a search's probes and a follower
    node's records are no plan's documents; a job's folder is the documents it lists."""
    assert plan_documents(measured["one"]) == [measured["one"] / "results.json"]
    assert [p.parent.name for p in plan_documents(measured["plans"])] == ["dp", "mp"]
    root = tmp_path / "tree"
    shutil.copytree(measured["plans"], root / "a")
    shutil.copytree(measured["one"], root / "b" / "node-0")
    follower = {**results.load(measured["one"]), "role": "follower"}
    (root / "b" / "node-1").mkdir()
    (root / "b" / "node-1" / "results.json").write_text(json.dumps(follower))
    (root / "s" / "probes" / "batch_size-8").mkdir(parents=True)
    (root / "s" / "search.json").write_text("{}")
    shutil.copy(measured["one"] / "results.json", root / "s" / "probes" / "batch_size-8")
    assert [p.relative_to(root).as_posix() for p in plan_documents(root)] == \
        ["a/dp/results.json", "a/mp/results.json", "b/node-0/results.json"]
    shutil.copy(measured["one"] / "results.json", root / "b" / "results.json")
    (root / "b" / "job.json").write_text(json.dumps({"documents": ["results.json"]}))
    assert "b/results.json" in [p.relative_to(root).as_posix() for p in plan_documents(root)]
    assert "b/node-0/results.json" not in [p.relative_to(root).as_posix()
                                           for p in plan_documents(root)]


def test_follow_ups_read_a_folder_of_several_plans(measured, tmp_path, capsys):
    """What a run of several plans wrote (`--framework a,b`, `--fc dp,mp`) is what report,
    project, compare, history and export take."""
    folder = str(measured["plans"])
    assert main(["report", folder, "--out", str(tmp_path / "r")]) == 0
    report = (tmp_path / "r" / "report.md").read_text()
    assert "fc=dp" in report and "fc=mp" in report
    assert main(["project", folder, "--to", "2n1g", "--inter-bw", "1",
                 "--out", str(tmp_path / "p")]) == 0
    assert sorted(p.parent.name for p in (tmp_path / "p").rglob("project.json")) == \
        ["dp", "mp"]
    assert main(["compare", folder, folder]) == 0
    assert main(["history", folder, folder, "--out", str(tmp_path / "h.html")]) == 0
    assert main(["export", folder, "--format", "dlperf", "--out",
                 str(tmp_path / "d.json")]) == 0
    assert set(json.loads((tmp_path / "d.json").read_text())) == {"dp", "mp"}
    capsys.readouterr()


# -- a node sweep on emulated nodes -------------------------------------------------------------

needs_root = pytest.mark.skipif(missing_privilege() is not None,
                                reason=f"emulated nodes: {missing_privilege()}")


@needs_root
@pytest.mark.slow
def test_an_emulated_node_sweep_is_one_document_in_one_mode(tmp_path):
    """1n1g on node 0, then 2n1g on both nodes: one document with both cases and a speedup
    on each; under --mode best the first count's probe decides and the second count takes its
    choice without probing (JAX has one mode on a CPU: the probe's record is made, and
    taken). The Slurm tests run the same sweep of two frameworks on a real Slurm."""
    out = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "trainperf.cli", "emulate", "--cases", "1n1g,2n1g", "--",
         "run", "tiny-arcface", "--framework", "jax", "--mode", "best", *TINY,
         "--out", str(out)], capture_output=True, text=True, timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    job = json.loads((out / "job.json").read_text())
    assert [s["nodes"] for s in job["steps"]] == [1, 2]
    (doc,) = [results.load(p) for p in plan_documents(out)]
    assert [c["case"] for c in doc["cases"]] == ["1n1g", "2n1g"]
    assert all(c["speedup"] is not None for c in doc["cases"])
    assert {c["mode"] for c in doc["cases"]} == {doc["mode_probe"]["chosen"]}
    later = results.load(out / "nodes-2" / "node-0")
    assert later["mode_probe"]["probed_in"] == str((out / "nodes-1" / "node-0").resolve())
    events = [json.loads(line) for line in
              (out / "nodes-2" / "node-0" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if "probe" in e and e.get("event") != "mode_probe"]
    report = (out / "report.md").read_text()
    assert "Measured in 2 parts, joined" in report


RECORD = Path(__file__).resolve().parents[1] / "benchmarks/results/node_sweep-emulated-cpu"


def test_the_recorded_sweeps_documents_are_its_node_folders_joined():
    """The record's documents and its README's table are what joining its node folders gives
    today: each count's leader, every speedup against 1n1g, one mode per framework."""
    from trainperf.scale import node_sweep

    steps = [node_sweep.Step(s["nodes"], tuple(s["devices_per_node"]))
             for s in json.loads((RECORD / "job.json").read_text())["steps"]]
    readme = (RECORD / "README.md").read_text()
    for plan in node_sweep.gather(RECORD, steps):
        again = join.join(plan.parts)
        stored = results.load(RECORD / plan.rel)
        assert [(c["case"], c["median_samples_per_s"], c["speedup"]) for c in again["cases"]] \
            == [(c["case"], c["median_samples_per_s"], c["speedup"]) for c in stored["cases"]]
        assert len({c["mode"] for c in stored["cases"]}) == 1 and not plan.missing
        for case in stored["cases"]:
            assert f"{case['median_samples_per_s']:.2f} | {case['speedup']:.2f}" in readme
