"""Margin-softmax classification heads over torch.distributed (dp, mp, pfc)."""

from .fc import MarginSoftmaxHead, SampledRowsSGD  # noqa: F401
from .margin import margin_target_logit  # noqa: F401
