"""``trainperf gpucheck`` (``make gpu-check``): the offline GPU suite, in parts that fit a
borrowed machine.

GPU machines are lent rarely and briefly: one command of at most 10 minutes, no network, a few
files brought back. So the check installs nothing, runs its stages in order of value, each in a
process of its own under its own time cap (``plan.STAGES``), writes what each stage measured as
it goes (a stage that fails, hangs or runs out of time is recorded and the next one runs), and
leaves each part's folder self-contained: ``summary.md``, ``summary.json``, one ``.tar.gz`` of
every results folder and log, and the plots.

Stages: 1 the machine's ceiling (matmul TFLOP/s per number format, device-to-device copy);
2 GPU correctness (losses against the CPU from the same start, fp16/bf16, CUDA events against
the host clock, peak memory against the model); 3 the seeds' table on one GPU beside DLPerf's
V100 rows, with MFU and samples per joule; 4 capacity (max batch, max classes) and a refit of
the memory model's GPU constants; 5 peers (timm's ResNet50 step, trainperf's JAX worker);
6 real data against its synthetic twin.

Without a GPU the same stages run at tiny sizes on the CPU (``make test`` runs them), with the
checks that need a GPU recorded as not run.
"""
