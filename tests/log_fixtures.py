"""Writers of synthetic logs in each external format, carrying rates chosen by the test."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path


def speedometer(rates_by_window: list[float], warmup_rate: float = 50.0, iter_style=False) -> str:
    """MXNet Speedometer every 20 batches: [0-20] is warm-up, then one line per window."""
    lines = ["INFO:root:start training"]
    for i, rate in enumerate([warmup_rate, *rates_by_window]):
        lo, hi = 20 * i, 20 * (i + 1)
        if iter_style:
            lines.append(f"INFO:root:Iter[0] Batch [{hi}]\tSpeed: {rate:.2f} samples/sec")
        else:
            lines.append(f"INFO:root:Epoch[0] Batch [{lo}-{hi}]\tSpeed: {rate:.2f} samples/sec"
                         "\tacc=0.000000")
    return "\n".join(lines) + "\n"


def partialfc(totals: list[float], world: int, every: int = 20) -> str:
    lines = []
    for i, total in enumerate(totals):
        lines.append(f"Iter:{every * (i + 1)} Rank:{total / world:.2f} it/sec "
                     f"Total:{total:.2f} it/sec [0][loss]:0.01")
    return "\n".join(lines) + "\n"


def oneflow(rates: list[float]) -> str:
    return "".join(f"train: iter {i}, loss 5.95467472076416, throughput: {r:.3f}\n"
                   for i, r in enumerate(rates))


def plsc(qps_by_batch: dict[int, float]) -> str:
    return "".join(f"Pass:0 batch:{b} lr:0.10000000 loss:23.123456 qps:{q:.2f}\n"
                   for b, q in sorted(qps_by_batch.items()))


def arcface_torch(speeds_by_step: dict[int, float], loss: float = 40.5) -> str:
    return "".join(f"Training: Speed {s:.2f} samples/sec   Loss {loss:.4f}   LearningRate "
                   f"0.007692   Epoch: 0   Global Step: {g}   Required: 0 hours\n"
                   for g, s in sorted(speeds_by_step.items()))


def timehistory(entries: list[tuple[float, float, int, int]]) -> str:
    return "".join(f"TimeHistory: {sec:.2f} seconds, {rate:.2f} examples/second between "
                   f"steps {a} and {b}\n" for sec, rate, a, b in entries)


def dllogger(step_seconds: list[float], ips: float = 812.3) -> str:
    t = datetime(2020, 9, 15, 14, 29, 16, 161849)
    lines = []
    for i, dt in enumerate(step_seconds):
        t += timedelta(seconds=dt)
        lines.append(f"DLL {t.strftime('%Y-%m-%d %H:%M:%S.%f')} - Epoch: 0 Iteration: {i + 1}  "
                     f"train.loss : 7.0 train.total_ips : {ips:.1f} img/s")
    return "\n".join(lines) + "\n"


def write_run(root: Path, batch: int, case: str, model: str, precision: str, run: int,
              text: str) -> Path:
    path = root / f"bz{batch}" / case / f"{model}_b{batch}_{precision}_{run}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
