import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, os.cpu_count() or 1))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def mxnet_python() -> str:
    """The MXNet environment's interpreter, built on first use and cached across sessions
    (``~/.cache/trainperf/envs``, or ``$TRAINPERF_ENV_DIR``)."""
    from trainperf import envs

    envs.create("mxnet", cuda=False)
    return envs.interpreter("mxnet")
