"""A sweep of the number of classes (``run --num-classes 1000,100000 --fc mp,pfc``): one plan
per class count and head, speedups within each, and the report's identities table and plots,
on hand-made results (no run starts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainperf import results
from trainperf.cli import EXIT_USAGE, build_parser, main
from trainperf.cli.common import plan_from_args
from trainperf.report import classes as classes_report
from trainperf.report import plots as plots_report
from trainperf.report.assemble import write_report


def plans_of(*argv: str) -> list:
    return plan_from_args(build_parser().parse_args(["run", "tiny-arcface", "--device", "cpu",
                                                     *argv]))


def test_a_list_of_class_counts_makes_a_plan_per_count_and_head(tmp_path):
    plans = plans_of("--num-classes", "1000,100000", "--fc", "mp,pfc", "--devices", "1,2",
                     "--out", str(tmp_path))
    assert [(p.workload.num_classes, p.workload.fc, p.workload.sample_ratio) for p in plans] == [
        (1000, "mp", 1.0), (1000, "pfc", 0.1), (100000, "mp", 1.0), (100000, "pfc", 0.1)]
    assert [p.out_dir.name for p in plans] == ["c1000-mp", "c1000-pfc0.1", "c100000-mp",
                                               "c100000-pfc0.1"]
    assert all(p.out_dir.parent == tmp_path for p in plans)
    for p in plans:  # every point runs the whole device matrix
        assert [c.topology.devices_per_node for c in p.cases] == [1, 2]
    # Several frameworks: each framework's points, named by both.
    two = plans_of("--num-classes", "1000,2000", "--framework", "torch,mxnet",
                   "--out", str(tmp_path))
    assert [p.out_dir.name for p in two] == ["torch-c1000", "torch-c2000", "mxnet-c1000",
                                             "mxnet-c2000"]


def test_a_ratio_list_is_pfcs_and_keeps_the_other_heads(tmp_path):
    """``--fc mp,pfc --sample-ratio 0.2``: the ratio is Partial FC's; mp still runs, at every
    class."""
    plans = plans_of("--fc", "mp,pfc", "--sample-ratio", "0.2", "--out", str(tmp_path))
    assert [(p.workload.fc, p.workload.sample_ratio) for p in plans] == [("mp", 1.0),
                                                                           ("pfc", 0.2)]
    plans = plans_of("--fc", "dp,pfc", "--sample-ratio", "0.1,0.5", "--out", str(tmp_path))
    assert [(p.workload.fc, p.workload.sample_ratio) for p in plans] == [
        ("dp", 1.0), ("pfc", 0.1), ("pfc", 0.5)]


def test_one_value_plans_as_before(tmp_path):
    (plan,) = plans_of("--num-classes", "2000", "--fc", "pfc", "--out", str(tmp_path))
    assert plan.out_dir == tmp_path and plan.variant is None
    assert (plan.workload.num_classes, plan.workload.fc, plan.workload.sample_ratio) == (
        2000, "pfc", 0.1)


@pytest.mark.parametrize("argv,words", [
    (["--num-classes", "0"], "--num-classes takes counts of 2 or more"),
    (["--num-classes", "abc"], "--num-classes takes comma-separated integers"),
    (["--num-classes", "1000,1000"], "names a count twice"),
    (["--fc", "mp,xx"], "--fc takes dp, mp, pfc"),
    (["--sample-ratio", "0.1,x", "--fc", "pfc"], "--sample-ratio takes comma-separated"),
    (["--fc", "dp,mp", "--sample-ratio", "0.2"], "a ratio below 1 needs --fc pfc"),
    (["--fc", "mp", "--sample-ratio", "0.2"], "--sample-ratio below 1 needs --fc pfc"),
    (["--fc", "pfc", "--num-classes", "3", "--devices", "1,4"],
     "--fc pfc splits the 3 classes over 4 ranks, leaving 1 of them without a class"),
    (["--fc", "mp", "--num-classes", "2,3", "--devices", "4"],
     "--fc mp splits the 2 classes over 4 ranks"),
])
def test_bad_lists_are_one_line_usage_errors(argv, words, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["run", "tiny-arcface", "--device", "cpu", *argv, "--out", str(out)]) == (
        EXIT_USAGE)
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err
    assert not out.exists()


def ok_run(rate: float, peak_gib: float) -> dict:
    return {**results.run_record(1, [], "ok"), "samples_per_s": rate,
            "peak_memory_bytes": int(peak_gib * 2**30)}


def case(world: int, classes: int, fc: str, ratio: float, run: dict) -> dict:
    return results.case_record(results.CaseKey(1, world, 8), "fp32", [run], None,
                               head=(classes, fc, ratio))


def test_speedups_never_compare_class_counts():
    cases = [case(1, 1000, "mp", 1.0, ok_run(100.0, 1)),
             case(2, 1000, "mp", 1.0, ok_run(180.0, 1)),
             case(2, 100000, "mp", 1.0, ok_run(80.0, 2)),  # no 1-device base at 100000
             case(1, 1000, "pfc", 0.1, ok_run(120.0, 1)),
             case(2, 1000, "pfc", 0.1, ok_run(150.0, 1))]
    results.document("tiny-arcface", {}, {}, {}, cases)
    assert [c["num_classes"] for c in cases] == [1000, 1000, 100000, 1000, 1000]
    assert cases[1]["speedup"] == pytest.approx(1.8)
    assert cases[2]["speedup"] is None  # not 80 / 100: another class count
    assert cases[4]["speedup"] == pytest.approx(1.25)  # against pfc's own 1-device case
    # The 100000-class case is slower than the 1000-class one: no flag, as they are not a line.
    assert "throughput_falls" not in cases[2]["flags"]


def sweep_folders(root: Path, frameworks=("torch",)) -> list[str]:
    """Results folders of a sweep on 1 and 2 devices, each framework its own rates; mp at 1M
    classes ran out of memory on 2 devices, and pfc at 1M on every device count (so no worker
    ever told that folder the framework's own name, as in a real run)."""
    dirs = []
    for f, framework in enumerate(frameworks):
        for classes in (1000, 1000000):
            for fc, ratio in (("mp", 1.0), ("pfc", 0.1)):
                scale = (1 + f) * (2 if fc == "pfc" else 1) * (1000 / classes) ** 0.1
                oom = results.run_record(1, [], "oom", "CUDA out of memory")
                one, two = ok_run(100 * scale, 2.0), ok_run(150 * scale, 1.5)
                if classes == 1000000:
                    one, two = (one, oom) if fc == "mp" else (oom, oom)
                cases = [case(1, classes, fc, ratio, one), case(2, classes, fc, ratio, two)]
                named = {"framework": "pytorch" if framework == "torch" else framework}
                doc = results.document("tiny-arcface",
                                       {"num_classes": classes, "fc": fc, "sample_ratio": ratio,
                                        "precision": "fp32"}, {},
                                       {} if (classes, fc) == (1000000, "pfc") else named, cases)
                doc["framework"] = framework
                folder = root / f"{framework}-c{classes}-{fc}"
                results.write_json_atomic(folder / "results.json", doc)
                dirs.append(str(folder))
    return dirs


def test_the_report_tables_speed_and_memory_against_identities(tmp_path):
    text = write_report(sweep_folders(tmp_path), tmp_path).read_text()
    section = text.split("## Against the number of identities")[1].split("\n## ")[0]
    assert ("| identities | framework | head | devices | samples/s | speedup | "
            "peak memory / device (GiB) | memory kind |") in section
    rows = [line for line in section.splitlines() if line.startswith("| 1,")]
    assert [r.split(" | ")[:4] for r in rows] == [
        ["| 1,000", "torch", "mp", "1"], ["| 1,000", "torch", "mp", "2"],
        ["| 1,000", "torch", "pfc 0.1", "1"], ["| 1,000", "torch", "pfc 0.1", "2"],
        ["| 1,000,000", "torch", "mp", "1"], ["| 1,000,000", "torch", "mp", "2"],
        ["| 1,000,000", "torch", "pfc 0.1", "1"], ["| 1,000,000", "torch", "pfc 0.1", "2"]]
    # The stand-in records name no memory kind (as records from before workers named it):
    # the table says so rather than guess one.
    assert rows[1].endswith("| 150.00 | 1.50 | 1.50 | kind not recorded |")
    # The failed cases, as failed, under their framework like every other.
    assert [r.endswith("| **oom** | - | - | kind not recorded |") for r in rows] == \
        [False] * 5 + [True] * 3
    assert "## Comparison" not in text  # one framework: nothing to set side by side
    assert "classes=1000000" in text  # each point's own section says its class count
    pytest.importorskip("matplotlib")
    for name in ("classes_throughput.png", "classes_memory.png"):
        assert (tmp_path / name).stat().st_size > 1000 and f"]({name})" in text


def test_frameworks_are_compared_only_at_the_same_point(tmp_path):
    text = write_report(sweep_folders(tmp_path, ("torch", "mxnet")), tmp_path).read_text()
    headers = [line for line in text.splitlines() if line.startswith("## Comparison")]
    assert len(headers) == 4  # one per (classes, head), each torch against mxnet
    assert all("classes=" in h and "fc=" in h for h in headers)
    tables = [part.split("\n## ")[0] for part in text.split("## Comparison")[1:]]
    ratios = [line.split(" | ")[-1].rstrip(" |") for table in tables
              for line in table.splitlines() if line.startswith("| 1 | 1 | 8 |")]
    # mxnet's rates are torch's doubled at every point that gave a figure; one run a side with
    # no step times leaves its interval the point itself.
    assert ratios == ["2.000 (2.000-2.000)"] * 3 + ["-"]


def test_no_matplotlib_no_plot_and_the_table_stays(tmp_path, monkeypatch):
    monkeypatch.setattr(classes_report, "_pyplot", lambda: None)
    monkeypatch.setattr(plots_report, "_pyplot", lambda: None)
    text = write_report(sweep_folders(tmp_path), tmp_path).read_text()
    assert "## Against the number of identities" in text and "install the `plot` extra" in text
    assert not list(tmp_path.glob("*.png"))


def test_memory_of_different_kinds_is_never_set_side_by_side_unnamed(tmp_path):
    """An allocator's peak (torch) and device-wide used memory (MXNet) are different figures:
    each row says its kind, and each plotted line does when the kinds differ."""
    folders = sweep_folders(tmp_path, frameworks=("torch", "mxnet"))
    for folder in folders:
        path = Path(folder) / "results.json"
        doc = json.loads(path.read_text())
        for c in doc["cases"]:
            c["memory_kind"] = "device_used" if doc["framework"] == "mxnet" else "allocator_peak"
        path.write_text(json.dumps(doc))
    text = write_report(folders, tmp_path).read_text()
    section = text.split("## Against the number of identities")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| 1,000 |")]
    assert {r.split(" | ")[1]: r.rsplit(" | ", 1)[1] for r in rows} == {
        "torch": "allocator peak |", "mxnet": "device used |"}
    lines = classes_report._lines([results.load(f) for f in folders])
    assert "torch mp 1 dev (allocator peak)" in lines and "mxnet mp 1 dev (device used)" in lines
