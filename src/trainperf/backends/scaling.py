"""The dynamic loss-scale policy of every framework's fp16 step (standard library only): torch's
GradScaler's, so that frameworks skip and rescale alike. It starts at 2**16, halves the scale
on a step whose gradients overflowed (that step's update is skipped), and doubles it after
``INTERVAL`` clean steps in a row. Frameworks that keep the scale on the device (JAX,
TensorFlow, torch) follow these constants; MXNet and Paddle decide on the host with
``LossScale``."""

from __future__ import annotations

INIT = 2.0 ** 16
GROWTH = 2.0
BACKOFF = 0.5
INTERVAL = 2000


class LossScale:
    """The scale decided on the host, one decision for all ranks per step."""

    def __init__(self) -> None:
        self.scale = INIT
        self.clean_steps = 0

    def update(self, finite: bool) -> None:
        """After a step: ``finite`` is whether every gradient of every rank was finite."""
        if not finite:
            self.scale *= BACKOFF
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == INTERVAL:
            self.scale *= GROWTH
            self.clean_steps = 0
