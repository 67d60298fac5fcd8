"""Read folders of logs written by DLPerf-style tests into trainperf results documents."""

from .logdir import ingest_logdir  # noqa: F401
