"""Every `trainperf` command the README and the pages under docs/ show, read the way a user
would copy it: from shell code blocks (continuation lines joined, comments dropped) and from
inline code that starts with ``trainperf``. The command reference is left out: it is made from
the parsers themselves.

A page writes some commands as a synopsis: ``...`` for "the options above", ``a|b`` for a
choice, ``[X ...]`` for more of the same, ``<host>`` or ``$VAR`` for a value of the user's.
``argv`` turns each into one concrete command, so that the CLI's own parser can read it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHELLS = ("sh", "bash", "shell", "console", "")
RECIPE_FIRST = {"run", "train", "slurm", "align", "bench"}
"""Commands whose first positional is a recipe: a page's ``...`` stands for one."""


@dataclass(frozen=True)
class PageCommand:
    page: str
    line: int
    text: str
    """As the page shows it."""
    argv: tuple[str, ...]
    """What follows ``trainperf``, with a synopsis made concrete."""
    inline: bool

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def pages() -> list[Path]:
    docs = sorted(p for p in (REPO / "docs").rglob("*.md") if "reference" not in p.parts)
    return [REPO / "README.md", *docs]


def _make_default(name: str) -> str:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return re.search(rf"^{name} \?= (.*)$", text, re.M).group(1).strip()


def argv(text: str, earlier: dict[str, tuple[str, ...]] | None = None
         ) -> tuple[str, ...] | None:
    """The tokens after ``trainperf`` (or ``python -m trainperf.cli``) up to a redirection or
    the next command; None where the line runs some other program. ``...`` stands for the
    options of the page's command above it of the same name (``earlier``), else a recipe."""
    text = text.replace("$(TEST_ENVS)", _make_default("TEST_ENVS"))
    text = re.sub(r"\$\([^)]*\)", "x", text)  # $(which python): the user's
    text = re.sub(r"<[^>]*>", "x", text)  # <first host>, <port>: a value of the user's
    text = re.sub(r"\s\[[^\]]*\]", "", text)  # [NEW2 ...]: more of the same
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):  # PYTHONPATH=src ...
        tokens = tokens[1:]
    if tokens[:3] == ["python", "-m", "trainperf.cli"]:
        tokens = tokens[3:]
    elif tokens[:1] == ["trainperf"]:
        tokens = tokens[1:]
    else:
        return None
    out: list[str] = []
    for tok in tokens:
        if tok in (">", "|", "&&", ";", "2>&1"):
            break
        if tok == "...":
            above = (earlier or {}).get(out[0]) if out else None
            if above:
                out += above[len(out):]
            elif len(out) == 1 and out[0] in RECIPE_FIRST:
                out.append("tiny-arcface")
            continue
        if tok.endswith("...") and not tok.startswith("-") and "/" not in tok:
            tok = tok[:-3]  # DIR...: one or more
        if tok.startswith("$"):
            tok = "4"  # $SLURM_NTASKS
        out.append(tok.split("|")[0] if "|" in tok and not tok.startswith("-") else tok)
    return tuple(out)


def _blocks(lines: list[str]):
    """(line number, text) of each shell command line in fenced code blocks."""
    fence, joined, start = None, "", 0
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        if fence is None or fence not in SHELLS:
            continue
        if not joined:
            start = number
        if stripped.endswith("\\"):
            joined += stripped[:-1] + " "
            continue
        yield start, joined + stripped
        joined = ""


def commands() -> list[PageCommand]:
    out = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        lines = text.splitlines()
        name = page.relative_to(REPO).as_posix()
        earlier: dict[str, tuple[str, ...]] = {}
        for number, line in _blocks(lines):
            got = argv(line, earlier)
            if got:
                out.append(PageCommand(name, number, line, got, inline=False))
                earlier.setdefault(got[0], got)
        for m in re.finditer(r"`(trainperf [^`]+)`", text):
            shown = " ".join(m.group(1).split())
            got = argv(shown)
            if got:
                out.append(PageCommand(name, text.count("\n", 0, m.start()) + 1, shown, got,
                                       inline=True))
    return out
