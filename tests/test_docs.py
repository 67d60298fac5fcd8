"""The documentation: the README is a short front page, every topic is a page under docs/ that
the site's nav lists, the site builds in strict mode (a broken link, anchor or nav entry fails
it), and the pages made from code say what the code says now."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainperf.cli import pages, reference

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


@pytest.fixture(scope="module")
def config() -> dict:
    # mkdocs.yml holds no Python tags, so the safe loader reads all of it.
    return yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))


def test_the_site_builds_in_strict_mode(tmp_path):
    # The test extra holds MkDocs and its theme, so make test always builds the site.
    assert importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material"), (
        "pip install -e '.[test]' (or '.[docs]') for mkdocs and mkdocs-material")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "commands" / "index.html").exists()


def test_the_command_reference_is_what_the_parsers_say(capsys):
    page = DOCS / "reference" / "commands.md"
    assert page.read_text(encoding="utf-8") == reference.render(), (
        "docs/reference/commands.md is out of date: run python -m trainperf.cli.reference "
        "--write docs/reference/commands.md")
    assert reference.main(["--check", str(page)]) == 0


def test_the_command_reference_covers_every_command_and_option():
    text = reference.render()
    for name in ("## trainperf run", "### trainperf data pack", "### trainperf env create",
                 "## trainperf gpucheck"):
        assert f"\n{name}\n" in text, name
    assert "| `--sample-ratio` | `SAMPLE_RATIO` |" in text
    # The project command's help says "(default %(default)g)": expanded as --help expands it.
    assert "%(" not in text and "(default 10)" in text


def test_a_stale_command_reference_says_how_to_remake_it(tmp_path, capsys):
    page = tmp_path / "commands.md"
    page.write_text("# old\n", encoding="utf-8")
    assert reference.main(["--check", str(page)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--write {page}" in err
    assert reference.main(["--write", str(page)]) == 0
    assert reference.main(["--check", str(page)]) == 0


def test_the_readme_is_a_short_front_page():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "```sh\nmake bench   # " in quick and "\nmake test    # " in quick
    listed = {line.split("](docs/", 1)[1].split(")", 1)[0] for line in text.splitlines()
              if line.startswith("| [") and "](docs/" in line}
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert listed == pages, "the README's page list and docs/ differ"


def test_every_page_is_in_the_nav(config):
    listed = set(nav_pages(config["nav"]))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), "pages missing from mkdocs.yml's nav"
    assert {"exports.md", "results-format.md"} <= listed


def test_strict_validation_covers_links_anchors_and_the_nav(config):
    v = config["validation"]
    assert v["links"] == {"not_found": "warn", "absolute_links": "warn",
                          "unrecognized_links": "warn", "anchors": "warn"}
    assert v["nav"] == {"omitted_files": "warn", "not_found": "warn", "absolute_links": "warn"}


def test_the_readme_sample_table_is_its_record():
    """The sample report's table is made from the record it names (``--readme-table``)."""
    spec = importlib.util.spec_from_file_location(
        "framework_compare", REPO / "benchmarks" / "framework_compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    text = (REPO / "README.md").read_text(encoding="utf-8")
    begin, end = "<!-- sample-report:begin -->\n", "<!-- sample-report:end -->"
    block = text.split(begin, 1)[1].split(end, 1)[0].strip("\n")
    record = REPO / "benchmarks" / "results" / "framework_compare-cpu" / "tiny-arcface-pfc"
    assert block == compare.readme_table(record), (
        "run python benchmarks/framework_compare.py --readme-table "
        f"{record.relative_to(REPO)} and paste it into the README")


def test_every_made_passage_says_what_the_code_and_the_records_say(capsys):
    """Tables and status lines made from declarations or records (``cli.pages``): the
    framework table, which frameworks ran on a GPU, the GPU check's parts and plan, the Python
    versions, ... each in every page that holds it."""
    assert pages.main(["--root", str(REPO), "--check"]) == 0, capsys.readouterr().err
    for name, block in pages.BLOCKS.items():
        for file in block.files:
            assert (REPO / file).is_file(), f"{name}: {file}"


def test_a_stale_or_missing_passage_is_named_with_the_command_that_remakes_it(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "install.md"
    begin, end = pages.markers("pythons")
    page.write_text(f"a\n{begin}\nold\n{end}\nb\n", encoding="utf-8")
    argv = ["--root", str(tmp_path), "--only", "pythons"]
    assert pages.main([*argv, "--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "docs/install.md: pythons out of date" in err
    assert f"--write --root {tmp_path}" in err
    assert pages.main([*argv, "--write"]) == 0 and pages.main([*argv, "--check"]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith(f"a\n{begin}\n| what | its Python |") and text.endswith(f"{end}\nb\n")
    page.write_text("no markers\n", encoding="utf-8")
    assert pages.main([*argv, "--write"]) == 2
    assert "docs/install.md: no <!-- pythons:begin -->" in capsys.readouterr().err
    assert page.read_text(encoding="utf-8") == "no markers\n"


def all_pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


PATH_TOKEN = re.compile(r"`([^`\s]+)`|\]\(([^)\s#]+)")


def named_paths() -> list[tuple[str, str, list[str]]]:
    """(page, path as written, where it may be) for every repository path a page names: a
    link, or code whose first folder is one of the repository's top level or of the package's
    (``gpucheck/budget.py``). Placeholders (``gpu-<device>-<date>``) match any name."""
    bases = {"": REPO, "src/trainperf/": REPO / "src/trainperf",
             "src/trainperf/backends/": REPO / "src/trainperf/backends"}
    tops = {base: {p.name for p in folder.iterdir()} for base, folder in bases.items()}
    out = []
    for page in all_pages():
        for m in PATH_TOKEN.finditer(page.read_text(encoding="utf-8")):
            written = m.group(1) or m.group(2)
            if written.startswith(("http:", "https:", "mailto:")):
                continue
            pattern = re.sub(r"<[^>]*>|\{[^}]*\}", "*", written).rstrip("/")
            if m.group(2):
                where = [(page.parent / pattern).relative_to(REPO).as_posix()]
            elif "/" in pattern:
                first = pattern.split("/")[0]
                where = [base + pattern for base, names in tops.items() if first in names]
            else:
                where = []
            if where:
                out.append((page.relative_to(REPO).as_posix(), written, where))
    return out


def test_every_path_a_page_names_exists():
    found = named_paths()
    assert len(found) > 100 and any(w == "benchmarks/results/gpu-h200-2026-11-26/README.md"
                                    for _, w, _ in found)
    missing = [f"{page}: {written}" for page, written, where in found
               if not any(glob.glob(str(REPO / w)) for w in where)]
    assert not missing, "pages name paths that are not in the tree:\n" + "\n".join(missing)


def test_the_pages_name_run_folders_as_the_runner_makes_them():
    """A run's folder is ``runs/<case>_b<batch>_run<N>/``: every page that shows one says so, and
    the recorded results' folders are named that way."""
    shown = {m.group(0) for page in all_pages()
             for m in re.finditer(r"runs/<[^`/]*>/", page.read_text(encoding="utf-8"))}
    assert shown and all(re.fullmatch(r"runs/<case>_b<batch>_run<[nN]>/", s) for s in shown), \
        shown
    recorded = [p.name for p in (REPO / "benchmarks/results").rglob("runs/*")
                if p.is_dir() and (p.parent.parent / "results.json").is_file()]
    assert recorded and all(re.fullmatch(r"\d+n\d+g_b\d+_(run\d+|probe-.+)", n)
                            for n in recorded), sorted(set(recorded))[:5]
