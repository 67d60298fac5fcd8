"""Every `trainperf` command the README and the pages show is one the command line takes: read
by the CLI's own parser, planned against the frameworks' declarations where it runs a
benchmark (for CUDA where the page's sizes are a GPU's, as `--device cuda` plans; `slurm` as a
login node without GPUs plans, for its nodes' devices), and run here where a CPU can, at tiny
sizes. A command that reads a folder another command of the same page writes reads the folder
that command wrote, run here at tiny sizes (on emulated nodes or the test Slurm where it runs
on several nodes). A renamed or removed flag, a recipe that no longer exists, a case a
framework no longer declares, or a follow-up that cannot read what the page's own run wrote
then fails here instead of in front of a user."""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from pathlib import Path

import pytest

import page_commands
from trainperf.cli import build_parser, main
from trainperf.cli.reference import subcommands

COMMANDS = page_commands.commands()
BLOCKS = [c for c in COMMANDS if not c.inline]
PLANNED = {"run", "slurm"}
"""Commands the test plans through run's own planning (the backends' declarations)."""


def command_parser(words: tuple[str, ...]) -> tuple[argparse.ArgumentParser, int]:
    """The parser of the (sub)command ``words`` starts with, and how many words named it."""
    parser, used = build_parser(), 0
    while used < len(words):
        subs = {name: sub for name, _, sub in subcommands(parser)}
        if words[used] not in subs:
            break
        parser = subs[words[used]]
        used += 1
    return parser, used


def parse(argv: tuple[str, ...]) -> argparse.Namespace:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(list(argv))
        except SystemExit as exc:
            raise AssertionError(f"{' '.join(argv)}: {err.getvalue().strip()}") from exc


def test_the_pages_show_commands_of_every_family():
    words = {c.argv[0] for c in COMMANDS}
    assert {"run", "slurm", "env", "train", "export", "compare", "gpucheck"} <= words
    assert len(BLOCKS) >= 50, "the extractor found too few commands: is it still reading?"


@pytest.mark.parametrize("command", BLOCKS, ids=str)
def test_every_command_in_a_code_block_is_read_by_the_cli(command):
    parse(command.argv)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.inline], ids=str)
def test_every_command_named_in_the_text_exists_with_its_flags(command):
    """Inline code names a command and some of its flags, not always a whole command line."""
    parser, used = command_parser(command.argv)
    assert used, f"{command}: no command {command.argv[0]!r}"
    flags = [t.split("=", 1)[0] for t in command.argv[used:] if t.startswith("--")]
    unknown = [f for f in flags if f not in parser._option_string_actions]
    assert not unknown, f"{command}: {parser.prog} has no {', '.join(unknown)}"


def _gpu_sized(command: page_commands.PageCommand) -> bool:
    return "cpu" not in command.argv and not any(a.startswith("tiny-") for a in command.argv)


@pytest.mark.parametrize("command", [c for c in BLOCKS if c.argv[0] in PLANNED], ids=str)
def test_every_benchmark_on_a_page_is_planned_without_a_refusal(command, tmp_path):
    """Planned as `run` plans it, against each framework's declaration for the device the page
    means: a `run` of a GPU's sizes for CUDA (as `--device cuda` plans it, on any host); a
    `slurm` job for its nodes' devices, as the login node that submits it plans it. Nothing
    starts."""
    from trainperf.cli.common import plan_from_args

    args = parse(command.argv)
    if command.argv[0] == "run" and _gpu_sized(command) and args.device == "auto":
        args.device = "cuda"
    if getattr(args, "data", None):
        # the page's dataset is the user's: a tiny one stands in
        args.data = str(synth_set(tmp_path))
    if getattr(args, "resume", None):
        args.resume = None  # a folder of the user's earlier run
    args.out = str(tmp_path / "out")
    if command.argv[0] == "slurm":
        from trainperf.cli.slurm import job_from_args

        job_from_args(args)  # plans every node's run with run's own parser
    else:
        assert plan_from_args(args)
    assert not (tmp_path / "out").exists()


def synth_set(where: Path) -> Path:
    prefix = where / "faces"
    if not prefix.with_suffix(".rec").exists():
        assert main(["data", "synth", "--identities", "8", "--images-per-identity", "8",
                     "--size", "32", "--val-pairs", "0", "--out", str(prefix)]) == 0
    return prefix


# What the CPU runs: every command that needs no GPU, no cluster and no data of the user's,
# at tiny sizes; the rest is read and planned above. The folders a page names as a user's
# earlier results are one tiny run's folder here.
SHRINK = {"run": {"--runs": "1", "--iters": "3", "--warmup": "1"},
          "data synth": {"--identities": "4", "--images-per-identity": "3", "--size": "32"},
          "data bench": {"--workers": "1", "--decoder": "auto"}}
READS_RESULTS = {"export", "report", "compare", "history", "project", "join"}
WRITERS = {"run", "slurm"}
"""Commands whose folder (``--out``) a later command of the same page may read."""
QUICK = {("list",), ("references",), ("env", "list"), ("gpucheck",)}


def runs_here(command: page_commands.PageCommand) -> bool:
    words = command.argv
    if "_PYTHON=" in command.text:
        return False  # an interpreter of the user's that holds the framework
    if words[0] == "gpucheck":
        return "--plan" in words
    if words[0] == "project" and ("--base" in words or "--fabric" in words):
        return False  # an 8-GPU node's case, a multi-node commbench: a cluster's records
    if words[:1] in QUICK or words[:2] in QUICK or words[0] in READS_RESULTS:
        return True
    if words[:2] in (("data", "synth"), ("data", "bench")):
        return True
    return words[0] == "run" and not _gpu_sized(command) and "--resume" not in words \
        and "--nnodes" not in words and "," not in _value(words, "--framework", "torch")


def _value(words: tuple[str, ...], flag: str, default: str = "") -> str:
    return words[words.index(flag) + 1] if flag in words else default


def folder_args(words: tuple[str, ...]) -> list[str]:
    """The folders a results-reading command names (its positionals)."""
    return [tok for i, tok in enumerate(words) if i > 0 and not tok.startswith("-")
            and not words[i - 1].startswith("--")]


def page_writers() -> dict[tuple[str, str], page_commands.PageCommand]:
    """(page, folder as the page names it) -> the command of that page that writes it, for
    every folder a later command of the same page reads."""
    out: dict[tuple[str, str], page_commands.PageCommand] = {}
    written: dict[tuple[str, str], page_commands.PageCommand] = {}
    for command in BLOCKS:
        words = command.argv
        if words[0] in READS_RESULTS:
            for tok in folder_args(words):
                if (command.page, tok) in written:
                    out[(command.page, tok)] = written[(command.page, tok)]
        if words[0] in WRITERS and "--out" in words:
            written.setdefault((command.page, _value(words, "--out")), command)
    return out


WRITTEN = page_writers()


def shrunk(words: tuple[str, ...], where: Path, folders: list[Path],
           page_folder=None) -> list[str]:
    """The command at a CPU's size, writing under ``where``, reading ``folders`` (or, for a
    folder the page's own command writes, ``page_folder(name)``'s)."""
    name = " ".join(words[:2]) if words[0] == "data" else words[0]
    changes = dict(SHRINK.get(name, {}))
    out, skip, used = [], False, 0
    for i, tok in enumerate(words):
        if skip:
            skip = False
            continue
        if tok in changes:
            out += [tok, changes.pop(tok)]
            skip = True
        elif tok in ("--out", "--json"):
            out += [tok, str(where / Path(words[i + 1]).name)]
            skip = True
        elif tok == "--fabric":
            out += [tok, str(page_commands.REPO / "benchmarks/results/commbench-cpu")]
            skip = True
        elif words[0] in READS_RESULTS and i > 0 and not tok.startswith("-") \
                and not words[i - 1].startswith("--"):
            made = page_folder(tok) if page_folder is not None else None
            if made is not None:
                out.append(str(made))
                continue
            count = 2 if "*" in tok else 1  # a glob: several folders
            out += [str(f) for f in folders[used:used + count]]
            used += count
        elif words[0] == "data" and i == 2 and not tok.startswith("-"):
            out.append(str(folders[-1]))  # data bench's dataset
        else:
            out.append(tok)
    for flag, value in changes.items():
        out += [flag, value]
    if words[0] in ("run", "data") and "--out" not in out and words[:2] != ("data", "bench"):
        out += ["--out", str(where / "out")]
    return out


@pytest.fixture(scope="module")
def earlier_results(tmp_path_factory) -> list[Path]:
    """Two folders of one tiny run each (a user's earlier results), then a tiny face set."""
    where = tmp_path_factory.mktemp("pages")
    assert main(["run", "tiny-arcface", "--device", "cpu", "--devices", "1", "--runs", "2",
                 "--iters", "4", "--warmup", "1", "--out", str(where / "a")]) == 0
    shutil.copytree(where / "a", where / "b")  # the same figures again: compare says so
    return [where / "a", where / "b", synth_set(where)]


@pytest.mark.parametrize("command", [c for c in BLOCKS if runs_here(c)], ids=str)
def test_every_command_a_cpu_can_run_runs_here(command, earlier_results, page_folders,
                                               tmp_path, capsys):
    def page_folder(name: str) -> Path | None:
        if (command.page, name) not in WRITTEN:
            return None
        made, why = page_folders(command.page, name)
        if made is None:
            pytest.skip(why)
        return made

    argv = shrunk(command.argv, tmp_path, earlier_results, page_folder)
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, f"{' '.join(argv)}: exit {code}: {captured.err.strip()[-400:]}"


def test_the_follow_ups_read_what_the_pages_own_runs_write():
    """The pages whose runs are followed by reports, exports, projections and joins of their
    folders: each such follow-up reads the folder its page's command wrote (above), not a
    stand-in."""
    pages = {page for page, _ in WRITTEN}
    assert {"docs/on-your-gpus.md", "docs/multi-node.md", "docs/usage.md"} <= pages
    assert {c.argv[0] for c in WRITTEN.values()} == {"run", "slurm"}


# -- the folders the pages' own commands write, made here at tiny sizes -------------------------

CAPPED = {"--devices": "1", "--runs": "1", "--iters": "3", "--warmup": "1"}
DROPPED = ("--precision", "--batch-size", "--partition", "--time", "--account",
           "--gpus-per-node", "--rdzv", "--nnodes", "--out", "--mode", "--submit", "--device")


def cpu_sized(words: tuple[str, ...]) -> tuple[list[str], int]:
    """A page's `run` or `slurm` at a CPU's size with the same shape of folders (a folder per
    framework where it compares several): the tiny recipe, fp32, one process per node, the
    first two of its frameworks and the first of its heads, each framework in its default mode
    (no probe), at most 2 nodes; and the node count to run it on."""
    out, nodes = [words[0], "tiny-arcface"], int(_value(words, "--nnodes", "1"))
    it = iter(enumerate(words))
    for i, tok in it:
        if i < 2:
            continue
        flag = tok.split("=")[0]
        takes_value = "=" not in tok and i + 1 < len(words) \
            and not words[i + 1].startswith("--")
        if flag in ("--framework", "--fc") and takes_value:
            out += [tok, ",".join(words[i + 1].split(",")[:2 if flag == "--framework" else 1])]
            next(it, None)
            continue
        if flag in DROPPED or flag in CAPPED or flag in ("--cases", "--nodes"):
            if flag == "--cases":
                counts = {int(c.split("n")[0]) for c in _value(words, "--cases").split(",")}
                nodes = min(max(counts), 2)
            elif flag == "--nodes":
                nodes = min(max(int(n) for n in _value(words, "--nodes").split(",")), 2)
            if takes_value:
                next(it, None)
            continue
        out.append(tok)
    for flag, value in CAPPED.items():
        out += [flag, value]
    out += ["--mode", "default", "--device", "cpu"]
    return out, nodes


@pytest.fixture(scope="module")
def page_folders(tmp_path_factory):
    """What a page's own command writes, made at most once: (its folder, None), or (None, why
    it cannot be made here)."""
    from slurm_host import SlurmHost, Unavailable
    from run_util import reserved_ports
    from trainperf.emulated_nodes import missing_privilege

    where = tmp_path_factory.mktemp("page-folders")
    made: dict[tuple[str, str], tuple[Path | None, str | None]] = {}
    slurm: list = []

    def make(page: str, name: str) -> tuple[Path | None, str | None]:
        if (page, name) in made:
            return made[(page, name)]
        words, nodes = cpu_sized(WRITTEN[(page, name)].argv)
        out = where / f"{len(made)}-{Path(name).name}"
        if words[0] == "slurm":
            if not slurm:
                host = SlurmHost()
                try:
                    host.start()
                except Unavailable as exc:
                    host.stop()
                    slurm.append(None)
                    made[(page, name)] = (None, f"no test Slurm: {exc}")
                    return made[(page, name)]
                slurm.append(host)
            if slurm[0] is None:
                made[(page, name)] = (None, "no test Slurm")
                return made[(page, name)]
            steps = "1,2" if nodes > 1 else "1"
            argv = [*words, "--nodes", steps, "--time", "5", "--rdzv-port",
                    str(reserved_ports(2)[0]), "--submit", "--out", str(out)]
        elif nodes > 1:
            why = missing_privilege()
            if why:
                made[(page, name)] = (None, f"emulated nodes: {why}")
                return made[(page, name)]
            argv = ["emulate", "--nodes", str(nodes), "--", *words, "--out", str(out)]
        else:
            argv = [*words, "--out", str(out)]
        code = main(argv)
        assert code == 0, f"{' '.join(argv)}: exit {code}"
        made[(page, name)] = (out, None)
        return made[(page, name)]

    yield make
    for host in slurm:
        if host is not None:
            host.stop()


def test_the_cpu_runs_cover_each_kind_of_command():
    ran = {c.argv[0] if c.argv[0] != "data" else " ".join(c.argv[:2])
           for c in BLOCKS if runs_here(c)}
    assert {"run", "export", "compare", "history", "report", "project", "list", "env",
            "data synth", "data bench"} <= ran, ran
