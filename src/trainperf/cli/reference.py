"""The command reference: every command of ``build_parser()`` as Markdown, made from the parsers'
own actions so that the page says what ``--help`` says and cannot drift from it.

    python -m trainperf.cli.reference                                   # print it
    python -m trainperf.cli.reference --write docs/reference/commands.md
    python -m trainperf.cli.reference --check docs/reference/commands.md

The page is rendered from the actions rather than from ``format_help``: argparse wraps its help
to the terminal's width and words its headings differently across Python releases, and the
page has to come out the same on every machine. The suite runs ``--check``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HEADER = """# Command reference

Every `trainperf` command with its options, made from the command line's own parsers by
`python -m trainperf.cli.reference --write docs/reference/commands.md` (the suite checks that
this page is what they say now). `trainperf COMMAND --help` prints the same. Every command also
takes `-h`/`--help`.
"""


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand, in the order they were registered."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return out


def _cell(text: str) -> str:
    """One line of Markdown, safe in a table: help text says `<recipe>` or `gpu-*` meaning the
    characters, which Markdown would take for a tag or emphasis outside a code span."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = (parts[i].replace("\\", "\\\\").replace("*", "\\*")
                    .replace("<", "&lt;").replace(">", "&gt;"))
    return "`".join(parts).replace("|", "\\|")


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest if not action.option_strings else action.dest.upper()


def _value(action: argparse.Action) -> str:
    """What follows the flag (or stands for a positional), by its nargs."""
    if action.nargs == 0:
        return ""
    m = _metavar(action)
    if action.nargs is None:
        return m
    if action.nargs == "?":
        return f"[{m}]"
    if action.nargs == "*":
        return f"[{m} ...]"
    if action.nargs == "+":
        return f"{m} [{m} ...]"
    if isinstance(action.nargs, int):
        return " ".join([m] * action.nargs)
    return m


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" not in text:
        return text
    # As argparse expands it: the action's own fields and the program's name.
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return text % params


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.required:
        return ""
    value = action.default
    if value is None or value is argparse.SUPPRESS:
        return ""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return f"`{value}`"


def usage(prog: str, parser: argparse.ArgumentParser) -> str:
    """One line in argparse's shape: required options, then [options], then positionals."""
    parts = [prog]
    shown = [a for a in parser._actions if a.help is not argparse.SUPPRESS
             and not isinstance(a, argparse._HelpAction)]
    optional = False
    for action in shown:
        if not action.option_strings:
            continue
        if action.required:
            parts.append(f"{action.option_strings[-1]} {_value(action)}".strip())
        else:
            optional = True
    if optional:
        parts.append("[options]")
    for action in shown:
        if action.option_strings:
            continue
        if isinstance(action, argparse._SubParsersAction):
            parts.append("COMMAND ...")
        else:
            parts.append(_value(action))
    return " ".join(parts)


def options_table(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    rows = []
    for action in parser._actions:
        if (action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction)
                or isinstance(action, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            name = ", ".join(f"`{s}`" for s in action.option_strings)
        else:
            name = f"`{_metavar(action)}`"
        value = _value(action) if action.option_strings else ""
        what = _help(action, prog)
        if action.required and action.option_strings:
            what = f"required. {what}" if what else "required"
        rows.append(f"| {name} | {_cell(f'`{value}`') if value else ''} | {_default(action)} "
                    f"| {_cell(what)} |")
    if not rows:
        return []
    return ["| argument | value | default | what it does |", "|---|---|---|---|", *rows]


def sections(prog: str, summary: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    """A command's heading (none for the program itself), what it does, its usage line, its
    options, and the same for each of its subcommands one level down."""
    out = [f"{'#' * level} {prog}", ""] if level > 1 else []
    for text in dict.fromkeys(t for t in (summary, parser.description) if t):
        out += [_cell(text), ""]
    out += ["```text", usage(prog, parser), "```", ""]
    table = options_table(parser, prog)
    if table:
        out += [*table, ""]
    subs = subcommands(parser)
    if subs:
        out += ["| command | what it does |", "|---|---|"]
        out += [f"| [`{prog} {name}`](#{_anchor(f'{prog} {name}')}) | {_cell(text)} |"
                for name, text, _ in subs]
        out.append("")
    for name, text, sub in subs:
        out += sections(f"{prog} {name}", text, sub, level + 1)
    return out


def _anchor(title: str) -> str:
    # The slug Markdown's toc extension gives a heading of plain words.
    return "-".join(title.lower().split())


def render() -> str:
    from . import build_parser

    parser = build_parser()
    body = sections("trainperf", "", parser, 1)
    return HEADER + "\n" + "\n".join(body).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, metavar="FILE", help="write the page to FILE")
    group.add_argument("--check", type=Path, metavar="FILE",
                       help="exit 1 when FILE is not what the parsers say now")
    args = p.parse_args(argv)
    page = render()
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(page, encoding="utf-8")
    elif args.check:
        old = args.check.read_text(encoding="utf-8") if args.check.exists() else None
        if old != page:
            print(f"{args.check} is out of date; run python -m trainperf.cli.reference "
                  f"--write {args.check}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
