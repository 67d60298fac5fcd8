"""The framework table: what every registered backend runs, read from each one's declaration
(``Backend.capabilities``), as rows, as the README's Markdown table and for `trainperf list
--frameworks`. Nothing here says it again: a backend that learns a head or a precision changes
its ``backend.py``, and the table follows."""

from __future__ import annotations

from ..config import GPU_SETTINGS, SETTING_OWNER, TUNING_SETTINGS, tuning_flag
from . import BACKENDS, catalog
from .base import DEVICE_KINDS, Backend

LAYOUT_COLUMN = "layout (CPU / GPU)"
COLUMNS = ("framework", "version", "heads", "precisions on a CPU", "precisions on a GPU",
           "backbones", "modes on a CPU", "modes on a GPU", LAYOUT_COLUMN,
           "layouts it runs", "real data (`--data`)", "trains to a target",
           "several nodes", "speed settings", "written as", "ranks start through")
FAMILY_NAMES = {"iresnet": "IResNet", "mobilefacenet": "MobileFaceNet",
                "resnet_v1b": "ResNet v1b"}


def version(backend: Backend) -> str:
    """The framework release its environment pins (the first package of its ``EnvSpec``);
    torch's is whatever is installed."""
    if backend.env is None:
        return "the installed one"
    return backend.env.packages[0].partition("==")[2] or "-"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def modes_text(backend: Backend, kind: str) -> str:
    """Its modes on a device kind, the one a single-framework run takes first and marked."""
    modes = backend.modes_on(kind)
    return ", ".join(f"**{m}**" if i == 0 else m for i, m in enumerate(modes)) or "-"


def layout_text(backend: Backend, kind: str) -> str:
    return "NHWC" if backend.default_layout(kind) == "channels_last" else "NCHW"


def layouts_text(backend: Backend) -> str:
    """What ``--memory-format auto`` runs on each device kind, the CPU's first: a framework's
    layout may differ between the two (torch's does)."""
    return " / ".join(layout_text(backend, kind) for kind in DEVICE_KINDS)


def row(backend: Backend) -> dict[str, str]:
    caps = backend.capabilities
    families = [f for f in catalog.FAMILIES if f in caps.families]
    return {
        "framework": backend.name,
        "version": version(backend),
        "heads": ", ".join(caps.heads),
        "precisions on a CPU": ", ".join(caps.precisions.get("cpu", ())) or "-",
        "precisions on a GPU": ", ".join(caps.precisions.get("cuda", ())) or "-",
        "backbones": ", ".join(FAMILY_NAMES[f] for f in families),
        "modes on a CPU": modes_text(backend, "cpu"),
        "modes on a GPU": modes_text(backend, "cuda"),
        LAYOUT_COLUMN: layouts_text(backend),
        "layouts it runs": ", ".join(name for name, runs in (("NCHW", caps.channels_first),
                                                             ("NHWC", caps.channels_last))
                                     if runs),
        "real data (`--data`)": _yes(caps.real_data),
        "trains to a target": _yes(caps.trains),
        "several nodes": _yes(caps.several_nodes),
        "speed settings": ", ".join(f"`{s}`" for s in caps.tuning) or "-",
        "written as": backend.runs_as,
        "ranks start through": backend.ranks_start,
    }


def rows() -> list[dict[str, str]]:
    return [row(b) for b in BACKENDS.values()]


def markdown_table() -> str:
    """The README's framework table (a test keeps the README's copy equal to this)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in rows()]
    return "\n".join(lines)


def tuning_cell(backend: Backend, name: str) -> str:
    """How ``backend`` honours speed setting ``name``: its own switch, or why it does not."""
    switch = backend.capabilities.tuning.get(name)
    if switch:
        return switch
    owner = SETTING_OWNER.get(name)
    if owner is not None and owner != backend.name:
        return "not its setting"
    return "refused"


def tuning_table() -> str:
    """Each speed setting (``config.TUNING_SETTINGS``, as the command line spells it) against
    each framework: the switch of its own that honours it, or ``refused`` (a run that changes
    it from its default is refused before it starts). The frameworks page holds this table."""
    from ..config import Tuning
    default = Tuning()
    names = [b.name for b in BACKENDS.values()]
    lines = ["| setting | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for name in TUNING_SETTINGS:
        value = getattr(default, name)
        if isinstance(value, bool):  # the flag turns the default around
            flag = f"`{tuning_flag(name, not value)}`"
        else:
            shown = f"{value:g}" if isinstance(value, float) else value
            flag = f"`{tuning_flag(name, value).split()[0]}` (default {shown})"
        where = " (GPU)" if name in GPU_SETTINGS else ""
        cells = [tuning_cell(b, name).replace("|", "\\|") for b in BACKENDS.values()]
        lines.append(f"| {flag}{where} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
