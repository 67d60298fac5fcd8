"""`trainperf compare` and `history`: the verdicts on result sets with a known difference, the
exit codes a CI job reads, the pairing of cases, the intervals of a report's ratio columns, and
the history page as a real browser shows it."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import synthetic_results as sr
from browser_host import browser  # noqa: F401  (the fixture)
from trainperf import significance
from trainperf.cli import main
from trainperf.report import history as history_report
from trainperf.report.assemble import write_report

pytest.importorskip("scipy")


def verdict(base_rate: float, new_rate: float, runs: int, seed: int, run_cv: float = 0.02):
    rng = np.random.default_rng(seed)
    base = sr.case_of(sr.runs_of(base_rate, runs, rng, run_cv=run_cv))
    new = sr.case_of(sr.runs_of(new_rate, runs, rng, run_cv=run_cv))
    return significance.compare_cases(base, new)


# -- the verdicts --------------------------------------------------------------------------------

def test_a_5_percent_loss_is_slower_at_enough_runs_and_undecided_at_two():
    # 2% run-to-run spread and 5% step-to-step: what runs of one case do on the CPU.
    enough = [verdict(100, 95, 20, seed) for seed in range(20)]
    verdicts = Counter(c.verdict for c in enough)
    # The interval must lie wholly below 0.98: at 20 runs a side it does in 96% of sets.
    assert verdicts["slower"] >= 18 and verdicts["slower"] + verdicts["not enough runs"] == 20
    slower = [c for c in enough if c.verdict == "slower"]
    assert all(c.high < 0.98 and c.p_value < 0.05 and 0.92 < c.ratio < 0.98 for c in slower)
    assert {c.interval_method for c in enough} == {"bootstrap over runs"}
    two = [verdict(100, 95, 2, seed) for seed in range(20)]
    assert [c.verdict for c in two] == ["not enough runs"] * 20
    # The rank test cannot reject at 2 runs a side (its smallest p is 1/3): the runs, not the
    # interval, are short.
    assert all(c.p_value >= 1 / 3 for c in two)
    assert {c.interval_method for c in two} == {
        "bootstrap over runs and blocks of step times"}
    assert all(c.runs_needed >= significance.min_runs_for_rank_test() for c in two)


def test_the_runs_it_asks_for_mostly_decide():
    """Where 2 runs a side cannot decide, the runs it says would, drawn afresh, decide more
    often than not (it aims at 80%, from a spread two runs only roughly show)."""
    asked = verdict(100, 95, 2, seed=3).runs_needed
    assert 4 <= asked <= 40
    decided = Counter(verdict(100, 95, asked, seed).verdict for seed in range(100, 140))
    assert decided["slower"] > 0.5 * 40 and decided["faster"] == decided["no change"] == 0


def test_identical_distributions_are_no_change_in_95_percent_of_trials():
    # A GPU's run-to-run spread (1%) at 20 runs a side: narrow enough to say "within 2%".
    verdicts = Counter(verdict(100, 100, 20, seed, run_cv=0.01).verdict for seed in range(200))
    assert verdicts["no change"] >= 0.95 * 200
    # On the CPU's noisier runs it may not decide, but it does not cry wolf either.
    noisy = Counter(verdict(100, 100, 10, seed).verdict for seed in range(200))
    assert noisy["slower"] + noisy["faster"] <= 0.05 * 200


def test_the_rank_test_needs_four_runs_a_side():
    assert significance.min_runs_for_rank_test(0.05) == 4
    assert significance.min_runs_for_rank_test(0.2) == 3


def test_no_usable_run_is_no_figure():
    rng = np.random.default_rng(0)
    failed = sr.case_of([{**r, "status": "oom", "samples_per_s": None}
                         for r in sr.runs_of(100, 2, rng)])
    c = significance.compare_cases(sr.case_of(sr.runs_of(100, 3, rng)), failed)
    assert c.verdict == "no figure" and c.ratio is None and c.new_runs == 0


# -- the command and its exit codes ---------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    return {"base": sr.folder_of(root / "base", 100, 20, 1),
            "slower": sr.folder_of(root / "slower", 95, 20, 2, commit="b" * 40),
            "faster": sr.folder_of(root / "faster", 105, 20, 3, version="2.14.0"),
            "base2": sr.folder_of(root / "base2", 100, 2, 6),
            "two": sr.folder_of(root / "two", 95, 2, 4, commit="b" * 40),
            "pfc": sr.folder_of(root / "pfc", 100, 20, 5, fc="pfc")}


def test_exit_codes(folders, capsys):
    f = {k: str(v) for k, v in folders.items()}
    assert main(["compare", f["base"], f["slower"]]) == 1
    err = capsys.readouterr().err
    assert "slower in " + f["slower"] in err
    assert main(["compare", f["base"], f["faster"]]) == 0
    assert main(["compare", f["base"], f["faster"], "--fail-on", "any-change"]) == 1
    assert main(["compare", f["base2"], f["two"]]) == 0  # undecided is not a slowdown
    assert main(["compare", f["base"], f["base"]]) == 0
    capsys.readouterr()
    assert main(["compare", f["base2"], f["two"]]) == 0
    out = capsys.readouterr().out
    assert "| 2 / 2 | not enough runs (about " in out and "a side would decide) |" in out
    with pytest.raises(SystemExit) as exc:
        main(["compare", f["base"], f["slower"], "--threshold", "two"])
    assert exc.value.code == 2
    # A higher threshold forgives the 5% loss.
    assert main(["compare", f["base"], f["slower"], "--threshold", "8%"]) == 0


def test_the_output_names_what_differs_and_each_verdict(folders, capsys, tmp_path):
    f = {k: str(v) for k, v in folders.items()}
    out_json = tmp_path / "cmp.json"
    assert main(["compare", f["base"], f["slower"], f["faster"], f["pfc"],
                 "--json", str(out_json)]) == 1
    text = capsys.readouterr().out
    sections = text.split("\n## ")[1:]
    assert [s.splitlines()[0] for s in sections] == [
        f"{f[k]} against {f['base']}" for k in ("slower", "faster", "pfc")]
    assert "What differs: trainperf_commit aaaaaaaaaaaa -> bbbbbbbbbbbb." in sections[0]
    assert "What differs: framework_version 2.13.0 -> 2.14.0." in sections[1]
    assert "fc dp -> pfc" in sections[2]  # the head is the subject: it pairs despite it
    assert "| slower |" in sections[0] and "| faster |" in sections[1]
    doc = json.loads(out_json.read_text())
    assert [c["pairs"][0]["verdict"] for c in doc["comparisons"]][:2] == ["slower", "faster"]
    first = doc["comparisons"][0]["pairs"][0]
    assert first["low"] < first["ratio"] < first["high"] < 1
    assert first["key"]["fc"] == "dp" and first["base_runs"] == 20


def test_cases_only_one_side_has_are_listed(tmp_path, capsys):
    rng = np.random.default_rng(0)
    one = sr.case_of(sr.runs_of(100, 5, rng))
    two_dev = {**sr.case_of(sr.runs_of(180, 5, rng), world=2)}
    big_batch = sr.case_of(sr.runs_of(120, 5, rng), batch=16)
    base = sr.write(tmp_path / "base", sr.doc_of([one, two_dev]))
    new = sr.write(tmp_path / "new", sr.doc_of([sr.case_of(sr.runs_of(100, 5, rng)), big_batch]))
    assert main(["compare", str(base), str(new)]) == 0
    out = capsys.readouterr().out
    assert f"Only in {base}: tiny-arcface torch fc=dp 1000 classes fp32 1n2g b8." in out
    assert f"Only in {new}: tiny-arcface torch fc=dp 1000 classes fp32 1n1g b16." in out


def test_a_side_of_several_frameworks_pairs_them_framework_by_framework(tmp_path, capsys):
    def side(name, torch_rate, paddle_rate, seed):
        rng = np.random.default_rng(seed)
        for fw, rate in (("torch", torch_rate), ("paddle", paddle_rate)):
            sr.write(tmp_path / name / fw,
                     sr.doc_of([sr.case_of(sr.runs_of(rate, 8, rng))], framework=fw))
        return str(tmp_path / name)

    assert main(["compare", side("a", 100, 80, 1), side("b", 100, 70, 2)]) == 1
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| tiny-arcface")]
    assert [r.split(" | ")[0] for r in rows] == ["| tiny-arcface paddle fc=dp 1000 classes fp32 "
                                                 "1n1g b8", "| tiny-arcface torch fc=dp 1000 "
                                                 "classes fp32 1n1g b8"]
    assert rows[0].endswith("| slower |") and "slower" not in rows[1]


def moded(folder: Path, rate: float, asked: str, ran: str, seed: int) -> str:
    """A folder of one case timed in ``ran``, its plan having asked for ``asked``."""
    rng = np.random.default_rng(seed)
    doc = sr.doc_of([sr.case_of(sr.runs_of(rate, 8, rng))])
    doc["tuning"] = {"mode": asked}
    for case in doc["cases"]:
        case["mode"] = ran
        for run in case["runs"]:
            run["mode"] = ran
    return str(sr.write(folder, doc))


def test_two_best_folders_that_chose_differently_get_no_verdict(tmp_path, capsys):
    """Two `--mode best` folders whose probes chose eager and compile: the mode is the only
    difference, and nobody asked for it. Both figures, no faster or slower, exit 0; where the
    modes were asked for by name, the same figures are a fair question and get a verdict."""
    base = moded(tmp_path / "a", 100, "best", "eager", 1)
    new = moded(tmp_path / "b", 80, "best", "compile", 2)
    out_json = tmp_path / "cmp.json"
    assert main(["compare", base, new, "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "| modes differ (eager -> compile): no verdict |" in text
    (pair,) = json.loads(out_json.read_text())["comparisons"][0]["pairs"]
    assert pair["verdict"] == "modes differ"
    assert pair["base_median_samples_per_s"] > pair["new_median_samples_per_s"]
    assert main(["compare", moded(tmp_path / "c", 100, "eager", "eager", 1),
                 moded(tmp_path / "d", 80, "compile", "compile", 2)]) == 1
    assert "| slower |" in capsys.readouterr().out
    # The report of both: both figures, and no ratio between two steps nobody chose.
    report = write_report([base, new], tmp_path / "r").read_text()
    assert "modes differ (eager -> compile)" in report
    # History: the night whose probe flipped is not a regression.
    nights = [moded(tmp_path / f"n{i}", rate, "best", mode, i) for i, (rate, mode) in
              enumerate([(100, "eager"), (80, "compile"), (80.5, "compile")])]
    path, flagged = history_report.write_history(nights, tmp_path / "h.html")
    assert flagged == 0
    page = path.read_text()
    data = json.loads(page.split('id="trainperf-data">')[1].split("</script>")[0])
    (case,) = data["cases"]
    said = [(e.get("against_previous") or {}).get("verdict") for e in case["series"]]
    assert said[:2] == [None, "modes differ"] and said[2] not in ("slower", "modes differ")
    assert "modes differ (eager -&gt; compile): no verdict" in page


# -- bad input: one line naming the folder ----------------------------------------------------

def error_of(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("trainperf: error: ")
    return err


def test_bad_input_names_the_folder(folders, tmp_path, capsys):
    base = str(folders["base"])
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    text = (folders["slower"] / "results.json").read_text()
    (truncated / "results.json").write_text(text[: len(text) // 2])
    assert str(truncated) in error_of(["compare", base, str(truncated)], capsys)
    assert "not valid JSON" in error_of(["compare", base, str(truncated)], capsys)

    mixed = tmp_path / "mixed"
    sr.write(mixed / "one", json.loads(text))
    sr.write(mixed / "two", {**json.loads(text), "schema": "trainperf.results/v2"})
    err = error_of(["compare", base, str(mixed)], capsys)
    assert f"{mixed}: mixes result schemas" in err and "trainperf.results/v2" in err

    other = sr.folder_of(tmp_path / "rn50", 100, 3, 1, recipe="rn50-v1b-imagenet")
    err = error_of(["compare", base, str(other)], capsys)
    assert f"nothing comparable between {base} and {other}" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty}: no results.json" in error_of(["compare", base, str(empty)], capsys)
    missing = tmp_path / "missing"
    assert f"{missing}: no such folder" in error_of(["history", base, str(missing)], capsys)
    dup = tmp_path / "dup"
    sr.write(dup / "x", json.loads(text))
    sr.write(dup / "y", json.loads(text))
    assert f"{dup}: holds the case" in error_of(["compare", base, str(dup)], capsys)


# -- the report's comparison of frameworks ---------------------------------------------------

def test_framework_ratios_carry_their_interval(tmp_path):
    rng = np.random.default_rng(7)
    dirs = []
    for fw, rate in (("torch", 100), ("paddle", 130), ("mxnet", 101)):
        doc = sr.doc_of([sr.case_of(sr.runs_of(rate, 6, rng))], framework=fw)
        dirs.append(str(sr.write(tmp_path / fw, doc)))
    text = write_report(dirs, tmp_path / "rep").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 1 | 1 | 8 |"))
    paddle, mxnet = row.strip("| ").split(" | ")[-2:]
    low, high = (float(x) for x in paddle.split("(")[1].rstrip(")").split("-"))
    assert low < 1.3 < high and low > 1 and not paddle.endswith("~")
    assert mxnet.endswith(" ~")  # 1% apart with 2% spread: the interval holds 1.0
    assert "`~`: the interval holds 1.0" in text


# -- history --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def history_dirs(tmp_path_factory) -> list[str]:
    """Four nightly folders: steady, steady, 6% slower at the third (a new commit), back."""
    root = tmp_path_factory.mktemp("history")
    dirs = []
    for night, (rate, commit) in enumerate([(100, "a"), (100.5, "b"), (94, "c"), (100, "d")]):
        rng = np.random.default_rng(night)
        cases = [sr.case_of(sr.runs_of(rate, 10, rng)),
                 sr.case_of(sr.runs_of(rate * 1.8, 10, rng), world=2)]
        dirs.append(str(sr.write(root / f"night{night}", sr.doc_of(cases, commit=commit * 40))))
    return dirs


def test_history_marks_the_regression(history_dirs, tmp_path):
    out = tmp_path / "h.html"
    path, flagged = history_report.write_history(history_dirs, out)
    page = path.read_text()
    data = json.loads(page.split('id="trainperf-data">')[1].split("</script>")[0])
    assert [p["label"] for p in data["points"]] == ["night0", "night1", "night2", "night3"]
    assert data["points"][2]["differs"] == {"trainperf_commit": "c" * 12}
    verdicts = [[(e.get("against_previous") or {}).get("verdict") for e in c["series"]]
                for c in data["cases"]]
    assert [v[2] for v in verdicts] == ["slower", "slower"] and flagged == 2
    assert all("slower" not in (v[1], v[3]) for v in verdicts)
    # Nothing to fetch: no link, no source, no reference outside the page.
    assert "<link" not in page and "src=" not in page and "import " not in page
    assert not re.search(r'url\((?!#)|href="(?!#)', page)


def test_history_in_a_browser(history_dirs, tmp_path, browser):  # noqa: F811
    pytest.importorskip("matplotlib")
    page = tmp_path / "history.html"
    assert main(["history", *history_dirs, "--out", str(page)]) == 0
    loaded = browser.load(page)
    assert loaded.console == []  # no error, no message
    dom = loaded.dom
    assert 'data-ready="1"' in dom and 'data-cases="2"' in dom  # its script ran to the end
    assert dom.count("<svg") == 2 and dom.count('<section class="case"') == 2
    assert dom.count('<tr class="slower">') == 2
    assert "slower at night2" in dom
    # The check sees a page's errors: the same page with a broken script.
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace('getElementById("case-filter")',
                                               'getElementById("case-filter").nope.x'))
    seen = browser.load(broken)
    assert any("Uncaught TypeError" in m for m in seen.console)
    assert 'data-ready="1"' not in seen.dom


def test_history_without_matplotlib_keeps_its_tables(history_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(history_report, "_pyplot", lambda: None)
    path, _ = history_report.write_history(history_dirs, tmp_path / "h.html")
    page = path.read_text()
    assert "<svg" not in page and "No plots: install the <code>plot</code> extra" in page
    assert page.count('<tr class="slower">') == 2


def test_history_needs_a_case_seen_twice(tmp_path, capsys):
    a = sr.folder_of(tmp_path / "a", 100, 3, 1)
    b = sr.folder_of(tmp_path / "b", 100, 3, 2, recipe="rn50-v1b-imagenet")
    err = error_of(["history", str(a), str(b), "--out", str(tmp_path / "h.html")], capsys)
    assert "no case appears in two" in err
