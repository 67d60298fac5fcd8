"""``trainperf history``: throughput per case over result folders taken over time, as one HTML
file that needs no server and no network: its plots are inline SVG, its data an inline JSON
block, and a plain table stands beside each plot. Each point is judged against the one before it
as ``trainperf compare`` judges, and the ones it would call ``slower`` are marked; a point timed
in another mode than the one before it is said to differ in mode and is never judged (a
history is of one step over time)."""

from __future__ import annotations

import html
import io
import json
from pathlib import Path

import numpy as np

from .. import significance
from ..mode_choice import MODES_DIFFER
from ..stats import median
from .compare import case_label, load_side, match, side_description, verdict_text
from .markdown import interval_text
from .plots import _pyplot

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: left; }
td.num { text-align: right; }
tr.slower td { background: #fde2e2; }
figure { margin: 0; }
.note { color: #555; }
"""

SCRIPT = """
(function () {
  var data = JSON.parse(document.getElementById("trainperf-data").textContent);
  var pick = document.getElementById("case-filter");
  pick.addEventListener("change", function () {
    document.querySelectorAll("section.case").forEach(function (s) {
      s.hidden = pick.value !== "" && s.dataset.case !== pick.value;
    });
  });
  document.documentElement.dataset.cases = String(data.cases.length);
  document.documentElement.dataset.ready = "1";
})();
"""


def point_labels(names: list[str], descriptions: list[dict[str, str]]) -> list[dict]:
    """Each folder and what sets it apart from the others (commit, versions, device...)."""
    fields = dict.fromkeys(k for d in descriptions for k in d)
    varying = [k for k in fields if len({d.get(k, "-") for d in descriptions}) > 1]
    return [{"folder": name, "label": Path(name.rstrip("/")).name or name,
             "differs": {k: d.get(k, "-") for k in varying}}
            for name, d in zip(names, descriptions)]


def case_series(cases: list[dict | None], threshold: float, confidence: float) -> list[dict]:
    """One entry per folder: the case's figures there and its verdict against the previous
    folder that has the case."""
    out, previous = [], None
    for case in cases:
        if case is None:
            out.append(None)
            continue
        rates = [r.samples_per_s for r in significance.usable_runs(case)]
        q25, q75 = (float(q) for q in np.percentile(rates, [25, 75])) if rates else (None, None)
        point = {"median": median(rates), "iqr": q75 - q25 if rates else None, "q25": q25,
                 "q75": q75, "runs": rates, "runs_total": len(case["runs"])}
        if previous is not None:
            c = significance.compare_cases(previous, case, threshold, confidence)
            point["against_previous"] = c.to_dict()
            if previous.get("mode") != case.get("mode"):
                point["against_previous"].update(
                    verdict=MODES_DIFFER, modes=[previous.get("mode"), case.get("mode")])
        out.append(point)
        previous = case
    return out


def is_slower(entry: dict | None) -> bool:
    """Whether a point of a case's series is slower than the one before it."""
    return bool(entry) and (entry.get("against_previous") or {}).get("verdict") == "slower"


def plot_svg(label: str, points: list[dict], series: list[dict | None]) -> str | None:
    plt = _pyplot()
    if plt is None:
        return None
    import matplotlib

    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small, and no glyph ids
    matplotlib.rcParams["svg.hashsalt"] = "trainperf"
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    xs = [i for i, p in enumerate(series) if p and p["median"] is not None]
    for i in xs:
        p = series[i]
        ax.plot([i] * len(p["runs"]), p["runs"], ".", color="#9ab", ms=4, zorder=1)
    if xs:
        meds = [series[i]["median"] for i in xs]
        below = [series[i]["median"] - series[i]["q25"] for i in xs]
        above = [series[i]["q75"] - series[i]["median"] for i in xs]
        ax.errorbar(xs, meds, yerr=[below, above], fmt="o-", color="#246", capsize=3, zorder=2,
                    label="median (bar: quartiles; dots: runs)")
        slow = [i for i in xs if is_slower(series[i])]
        if slow:
            ax.plot(slow, [series[i]["median"] for i in slow], "v", color="#c22", ms=11,
                    zorder=3, label="slower than the point before")
    ax.set_xticks(range(len(points)), [p["label"] for p in points], rotation=20, ha="right",
                  fontsize=8)
    ax.set_ylabel("samples/s")
    ax.set_title(label, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})  # the same data, the same page
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]


def row_html(point: dict, entry: dict | None, threshold: float) -> str:
    cells = [html.escape(point["label"])]
    if entry is None:
        cells += ["-", "-", "-", "-", "not run"]
        cls = ""
    else:
        med, spread = entry["median"], entry["iqr"]
        cells += ["-" if med is None else f"{med:.2f}",
                  "-" if med is None or spread is None else f"{100 * spread / med:.1f}%",
                  f"{len(entry['runs'])}/{entry['runs_total']}"]
        prev = entry.get("against_previous")
        if prev is None:
            cells += ["-", "first point"]
            cls = ""
        else:
            modes = prev.get("modes")
            c = significance.Comparison(**{k: v for k, v in prev.items() if k != "modes"})
            said = (verdict_text(c, threshold, {"mode": modes[0]}, {"mode": modes[1]})
                    if modes else verdict_text(c, threshold))
            cells += [interval_text(c), html.escape(said)]
            cls = c.verdict.replace(" ", "-")
    # The point's name and its verdict are words; the rest are figures.
    tds = "".join(f"<td>{c}</td>" if i in (0, len(cells) - 1) else f'<td class="num">{c}</td>'
                  for i, c in enumerate(cells))
    return f'<tr class="{cls}">{tds}</tr>'


def render_html(points: list[dict], cases: list[dict], svgs: list[str | None],
                threshold: float, confidence: float) -> str:
    level = f"{100 * confidence:g}%"
    data = {"points": points, "cases": cases, "threshold": threshold, "confidence": confidence}
    blob = json.dumps(data).replace("</", "<\\/")
    flagged = [(c, points[i]) for c in cases for i, e in enumerate(c["series"])
               if is_slower(e)]
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>trainperf history</title>", f"<style>{STYLE}</style></head><body>",
             "<h1>trainperf history</h1>",
             f"<p>{len(points)} result folders, in the order given. Each point is judged "
             f"against the one before it as <code>trainperf compare</code> judges: the ratio "
             f"of medians with its {level} bootstrap interval, and <em>slower</em> where the "
             f"whole interval lies below {1 - threshold:g} (a loss beyond "
             f"{100 * threshold:g}%) and the rank test agrees.</p>",
             "<h2>Folders</h2>", "<table><tr><th>point</th><th>folder</th>"
             "<th>what sets it apart</th></tr>"]
    for p in points:
        what = "; ".join(f"{k} {v}" for k, v in p["differs"].items()) or "-"
        parts.append(f"<tr><td>{html.escape(p['label'])}</td><td>{html.escape(p['folder'])}"
                     f"</td><td>{html.escape(what)}</td></tr>")
    parts.append("</table>")
    parts.append("<h2>Regressions</h2>")
    if flagged:
        parts.append("<ul>" + "".join(
            f"<li>{html.escape(c['label'])}: slower at {html.escape(p['label'])}</li>"
            for c, p in flagged) + "</ul>")
    else:
        parts.append("<p>None: no point is slower than the one before it.</p>")
    if not any(svgs):
        parts.append('<p class="note">No plots: install the <code>plot</code> extra '
                     "(matplotlib) to get them.</p>")
    options = "".join(f'<option value="{i}">{html.escape(c["label"])}</option>'
                      for i, c in enumerate(cases))
    parts.append('<p><label>Case: <select id="case-filter"><option value="">all</option>'
                 f"{options}</select></label></p>")
    for i, (c, svg) in enumerate(zip(cases, svgs)):
        parts.append(f'<section class="case" data-case="{i}"><h2>{html.escape(c["label"])}</h2>')
        if svg:
            parts.append(f"<figure>{svg}</figure>")
        parts.append("<table><tr><th>point</th><th>samples/s (median)</th><th>IQR/median</th>"
                     f"<th>runs</th><th>ratio to previous ({level} CI)</th><th>verdict</th></tr>")
        parts += [row_html(p, e, threshold) for p, e in zip(points, c["series"])]
        parts.append("</table></section>")
    parts += [f'<script type="application/json" id="trainperf-data">{blob}</script>',
              f"<script>{SCRIPT}</script>", "</body></html>"]
    return "\n".join(parts) + "\n"


def write_history(dirs: list[str], out: Path, threshold: float = significance.THRESHOLD,
                  confidence: float = significance.CONFIDENCE) -> tuple[Path, int]:
    """Write the page; (its path, how many points it marks slower)."""
    sides = [load_side(d) for d in dirs]
    _, rows = match(sides)
    shared = {k: v for k, v in rows.items() if sum(c is not None for c in v) >= 2}
    if not shared:
        raise ValueError(f"nothing comparable across {', '.join(dirs)}: no case appears in two "
                         "of them")
    points = point_labels(dirs, [side_description(s) for s in sides])
    cases = [{"label": case_label(key), "key": dict(key),
              "series": case_series(row, threshold, confidence)} for key, row in shared.items()]
    svgs = [plot_svg(c["label"], points, c["series"]) for c in cases]
    page = render_html(points, cases, svgs, threshold, confidence)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    flagged = sum(is_slower(e) for c in cases for e in c["series"])
    return out, flagged
