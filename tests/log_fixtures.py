"""Writers of synthetic logs shaped like the real ones of each format (print interval, first
printed step, line prefixes), carrying the rates and times a test chooses."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

START = datetime(2020, 9, 15, 14, 29, 16, 161849)


def speeds_with_mean(value: float, n: int = 5) -> list[float]:
    """``n`` speeds of one decimal each (MXNet's script rounds each print to one) whose mean is
    ``value``: 233.94 from 233.9, 233.9, 233.9, 234.0, 234.0."""
    tenths = round(value * n * 10)
    if abs(tenths - value * n * 10) > 1e-6:
        raise ValueError(f"no {n} one-decimal speeds average exactly {value}")
    base, extra = divmod(tenths, n)
    return [base / 10] * (n - extra) + [(base + 1) / 10] * extra


def python_logging_time(t: datetime) -> str:
    """Python logging's default asctime: milliseconds after a comma."""
    return f"{t:%Y-%m-%d %H:%M:%S},{t.microsecond // 1000:03d}"


def speedometer(window_rates: list[float], warmup_rate: float = 50.0,
                after: tuple[float, ...] = (5000.0,), iter_style: bool = False, epoch: int = 0,
                times: list[datetime] | None = None) -> str:
    """MXNet Speedometer, one line every 20 batches: [0-20] (start-up), then one per window
    rate, then ``after`` (prints past DLPerf's window). ``times``: a Python logging time per
    line."""
    rates = [warmup_rate, *window_rates, *after]
    lines = ["INFO:root:start training"]
    for i, rate in enumerate(rates):
        lo, hi = 20 * i, 20 * (i + 1)
        if iter_style:
            line = f"INFO:root:Iter[{epoch}] Batch [{hi}]\tSpeed: {rate:.2f} samples/sec"
        else:
            line = (f"INFO:root:Epoch[{epoch}] Batch [{lo}-{hi}]\tSpeed: {rate:.2f} samples/sec"
                    "\tacc=0.000000")
        lines.append(f"{python_logging_time(times[i])} {line}" if times else line)
    return "\n".join(lines) + "\n"


def partialfc(totals: list[float], world: int) -> str:
    """MXNet Partial FC with config.frequent = 1: one line per iteration from iteration 1."""
    return "".join(f"Iter:{i} Rank:{total / world:.2f} it/sec Total:{total:.2f} it/sec "
                   "[0][loss]:0.01\n" for i, total in enumerate(totals, start=1))


def oneflow(rates: list[float]) -> str:
    """OneFlow InsightFace: one line per iteration from iteration 0."""
    return "".join(f"train: iter {i}, loss 5.95467472076416, throughput: {r:.3f}\n"
                   for i, r in enumerate(rates))


def plsc(qps_by_batch: dict[int, float | tuple[float, ...]], nodes: int = 1,
         seconds_per_batch: float | None = None) -> str:
    """PLSC's 'Pass:0 batch:' lines; on N nodes each batch is printed N times (a tuple gives
    each node's qps). ``seconds_per_batch``: a Python logging time on each line."""
    lines = []
    for batch, qps in sorted(qps_by_batch.items()):
        per_node = qps if isinstance(qps, tuple) else (qps,) * nodes
        prefix = ""
        if seconds_per_batch:
            t = START + timedelta(seconds=batch * seconds_per_batch)
            prefix = f"{python_logging_time(t)} - INFO - "
        lines += [f"{prefix}Pass:0 batch:{batch} lr:0.10000000 loss:23.123456 qps:{q:.2f}\n"
                  for q in per_node]
    return "".join(lines)


def arcface_torch(speeds_by_step: dict[int, float], loss: float = 40.5,
                  global_batch: int | None = None) -> str:
    """arcface_torch's CallBackLogging lines. With ``global_batch``, each line carries the
    logger's asctime, advanced by the steps since the last print at the printed Speed."""
    lines, t, last = [], START, 0
    for step, speed in sorted(speeds_by_step.items()):
        prefix = ""
        if global_batch:
            t += timedelta(seconds=(step - last) * global_batch / speed)
            prefix = f"{python_logging_time(t)}-"
        lines.append(f"Training: {prefix}Speed {speed:.2f} samples/sec   Loss {loss:.4f}   "
                     f"LearningRate 0.007692   Epoch: 0   Global Step: {step}   "
                     "Required: 0 hours\n")
        last = step
    return "".join(lines)


def absl_time(t: datetime) -> str:
    return f"I{t:%m%d %H:%M:%S.%f} 139871 keras_utils.py:119] "


def timehistory(entries: list[tuple[float, float, int, int]], logging_s: float = 0.0,
                start: datetime = START, stamped: bool = True) -> str:
    """TF TimeHistory lines, (seconds, examples/second, first step, last step) each. With
    ``stamped``, an absl prefix whose time advances by the printed seconds plus ``logging_s``."""
    lines, t = [], start
    for seconds, rate, first, last in entries:
        t += timedelta(seconds=seconds + logging_s)
        lines.append(f"{absl_time(t) if stamped else ''}TimeHistory: {seconds:.2f} seconds, "
                     f"{rate:.2f} examples/second between steps {first} and {last}\n")
    return "".join(lines)


def dllogger(step_seconds: list[float], ips: float | list[float] = 812.3) -> str:
    """NGC DLLogger, one line per iteration from iteration 1, each ``step_seconds`` after the
    last."""
    rates = ips if isinstance(ips, list) else [ips] * len(step_seconds)
    t, lines = START, []
    for i, (dt, rate) in enumerate(zip(step_seconds, rates), start=1):
        t += timedelta(seconds=dt)
        lines.append(f"DLL {t:%Y-%m-%d %H:%M:%S.%f} - Epoch: 0 Iteration: {i}  "
                     f"train.loss : 7.0  train.total_ips : {rate:.2f} img/s")
    return "\n".join(lines) + "\n"


def write_run(root: Path, batch: int, case: str, model: str, precision: str, run: int,
              text: str) -> Path:
    path = root / f"bz{batch}" / case / f"{model}_b{batch}_{precision}_{run}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
