"""What a multi-node run's records say of the network, in words: a lasting change of the step
time inside a run, and whether the link or the model changed, from the link probes node 0 took
on either side of it (``node_agreement.step_change`` and ``link_verdict``, kept in each run's
``step_change``)."""

from __future__ import annotations


def seconds_text(x: float) -> str:
    return f"{1000 * x:.1f} ms" if x < 1 else f"{x:.2f} s"


def bytes_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB"


def change_text(change: dict) -> str:
    """One run's step change and its verdict, e.g. ``steps 4.1x slower from step 12 (0.20 s ->
    0.82 s); the link to node 1 measured 95x slower ...: the link got slower, not the model``."""
    ratio = change["ratio"]
    slower = ratio > 1
    way = "slower" if slower else "faster"
    factor = ratio if slower else 1 / ratio
    text = (f"steps {factor:.1f}x {way} from step {change['at_step']} "
            f"({seconds_text(change['before_s'])} -> {seconds_text(change['after_s'])})")
    links = change.get("links") or {}
    probe = bytes_text(change.get("probe_bytes") or 0)

    def measured(node: str) -> str:
        m = links[node]
        moved = m["ratio"] if slower else 1 / m["ratio"]
        return (f"node {node}'s link measured {moved:.1f}x {way} ({probe} probe: "
                f"{seconds_text(m['before_s'])} -> {seconds_text(m['after_s'])}, "
                f"{m['probes'][0]} and {m['probes'][1]} probes)")

    verdict = change.get("verdict")
    if verdict == "link":
        said = "; ".join(measured(str(n)) for n in change["nodes"])
        return f"{text}; at the same time {said}: **the link got {way}**, not the model"
    if verdict == "model":
        said = "; ".join(measured(n) for n in sorted(links, key=int))
        return (f"{text}; {said}, the same within the noise: **the model got {way}** (the "
                f"nodes' compute or input), not the link")
    if not links:
        return (f"{text}; no link probe on both sides of the change: whether the link or the "
                f"model changed is unknown")
    said = "; ".join(measured(n) for n in sorted(links, key=int))
    if not change.get("probes_share_path", True):
        return (f"{text}; {said}, but the probes cross the network the nodes met on, which "
                f"the run's collectives (NCCL) may not: whether the link or the model changed "
                f"is unknown")
    return f"{text}; {said}: too little to tell the link from the model"


def change_lines(doc: dict) -> list[str]:
    """A line for every run whose step time changed part-way, with what changed."""
    out = []
    for c in doc["cases"]:
        for r in c["runs"]:
            if r.get("step_change"):
                out.append(f"- {c['case']} b{c['batch_size_per_device']} run {r['run']}: "
                           f"{change_text(r['step_change'])}")
    return out
