"""trainperf: trustworthy training-throughput benchmarks for face recognition and ResNet50."""

__version__ = "0.1.0"
