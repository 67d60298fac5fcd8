"""OneFlow IResNet backbones equal to the PyTorch ones in ``trainperf.backends.torch.backbones``.

OneFlow's ``nn`` mirrors torch's, so each module here is its torch twin written again with
``oneflow.nn``: the same layers in the same order, registered under the same attribute names,
so a OneFlow ``state_dict`` key *is* the torch key and the layouts are the same (OIHW
convolutions, [out, in] linear weights, BatchNorm ``weight``/``bias``/``running_mean``/
``running_var``/``num_batches_tracked``). :func:`load_torch_arrays` therefore loads the
``backbone/<torch name>`` arrays of an alignment ``.npz`` (``trainperf.config.AlignSpec.start``)
without renaming or transposing anything.

The family is InsightFace's IResNet: the unit is BN, 3x3 conv, BN, PReLU, 3x3 conv with the
stride, BN, plus the shortcut (1x1 conv with the stride and BN where the shape changes), no
activation after the addition. Output blocks as insightface's MXNet ``get_fc1``: ``E`` is BN,
dropout, FC (with bias), BN; ``FC`` the same without dropout. The embedding BN's gamma is fixed
at 1 (MXNet's ``fix_gamma``): a parameter that takes no gradient, counted in the parameter count
as torch counts it.

BatchNorm: eps 1e-5 and momentum 0.1 as torch's defaults; training-mode forward and backward use
the batch statistics. A float64 alignment run computes BatchNorm with tensor operations
(``exact_statistics``: OneFlow's kernel holds its epsilon and momentum as 32-bit floats,
``exact.py``). PReLU starts at 0.25 per channel. Initialisation follows OneFlow's
defaults, which copy torch's (``kaiming_uniform_(a=sqrt(5))`` for conv and linear weights);
alignment overwrites every value.

Only the IResNet family runs in this backend: MobileFaceNet and the classification ResNet50 are
not written here, and :func:`build_backbone` refuses them by name.
"""

from __future__ import annotations

from typing import Any, Callable

import oneflow as flow
import oneflow.nn as nn

from .. import catalog, layouts
from . import exact
from .backend import BACKEND

__all__ = ["backbone_names", "build_backbone", "load_torch_arrays", "param_count", "BN_EPS"]

BN_EPS = 1e-5


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _batch_norms(exact_statistics: bool) -> tuple[type, type]:
    """(BatchNorm1d, BatchNorm2d): OneFlow's, or for a float64 alignment run those that
    compute in float64 throughout, epsilon and momentum included (``exact.py`` says why)."""
    if exact_statistics:
        return exact.BatchNorm1d, exact.BatchNorm2d
    return nn.BatchNorm1d, nn.BatchNorm2d


class IBasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, bn2d: type = nn.BatchNorm2d) -> None:
        super().__init__()
        self.bn1 = bn2d(cin, eps=BN_EPS)
        self.conv1 = _conv3x3(cin, cout)
        self.bn2 = bn2d(cout, eps=BN_EPS)
        self.prelu = nn.PReLU(cout)
        self.conv2 = _conv3x3(cout, cout, stride)
        self.bn3 = bn2d(cout, eps=BN_EPS)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            bn2d(cout, eps=BN_EPS))

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet(nn.Module):
    def __init__(self, layers: tuple[int, int, int, int], *,
                 widths: tuple[int, int, int, int] = catalog.IRESNET_WIDTHS,
                 embedding_size: int = 512,
                 input_size: int = 112, output_block: str = "E", dropout: float = 0.0,
                 exact_statistics: bool = False) -> None:
        super().__init__()
        bn1d, bn2d = _batch_norms(exact_statistics)
        if input_size % 16:
            raise ValueError(f"IResNet needs an input side divisible by 16, got {input_size}")
        if output_block not in ("E", "FC"):
            raise ValueError(f"IResNet output block must be 'E' or 'FC', got {output_block!r}")
        stem = widths[0]
        self.conv1 = _conv3x3(3, stem)
        self.bn1 = bn2d(stem, eps=BN_EPS)
        self.prelu = nn.PReLU(stem)
        blocks = []
        cin = stem
        for width, count in zip(widths, layers):
            blocks.append(IBasicBlock(cin, width, 2, bn2d))
            blocks.extend(IBasicBlock(width, width, 1, bn2d) for _ in range(count - 1))
            cin = width
        self.body = nn.Sequential(*blocks)
        self.bn2 = bn2d(cin, eps=BN_EPS)
        self.dropout = nn.Dropout(dropout if output_block == "E" else 0.0)
        side = input_size // 16
        self.fc = nn.Linear(cin * side * side, embedding_size)
        self.features = bn1d(embedding_size, eps=BN_EPS)
        # InsightFace's fix_gamma: the embedding BN only centres and scales by the batch
        # statistics.
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad_(False)

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.bn2(self.body(x))
        x = self.dropout(flow.flatten(x, 1))
        return self.features(self.fc(x))


def _iresnet(b: catalog.Backbone, *, embedding_size: int, input_size: int, output_block: str,
             dropout: float, exact_statistics: bool) -> IResNet:
    return IResNet(**b.arch, embedding_size=embedding_size, input_size=input_size,
                   output_block=output_block, dropout=dropout,
                   exact_statistics=exact_statistics)


# family -> builder of a catalogue entry; every family the backend declares has one.
_BUILDERS: dict[str, Callable[..., nn.Module]] = {"iresnet": _iresnet}
CATALOG = catalog.BackendCatalog(BACKEND.capabilities.families, BACKEND.name)
backbone_names = CATALOG.names


def build_backbone(name: str, *, embedding_size: int | None = None, input_size: int = 112,
                   output_block: str = "E", dropout: float = 0.0,
                   exact_statistics: bool = False) -> IResNet:
    """The OneFlow twin of torch's ``build_backbone(name, ...)`` for the IResNet family
    (``embedding_size`` None: the catalogue's default, torch's). ``exact_statistics``: BatchNorm
    computed in the network's own dtype, epsilon and momentum included (a float64 alignment
    run's)."""
    entry = CATALOG.lookup(name)
    return _BUILDERS[entry.family](entry, embedding_size=entry.embedding(embedding_size),
                                   input_size=input_size, output_block=output_block,
                                   dropout=dropout, exact_statistics=exact_statistics)


def param_count(net: nn.Module) -> int:
    """``sum(p.numel() for p in net.parameters())``, as torch counts (the fixed gamma
    included, BN running statistics not)."""
    return sum(int(p.numel()) for p in net.parameters())


def load_torch_arrays(net: nn.Module, arrays: Any, prefix: str = "backbone/") -> None:
    """Set every parameter and buffer of ``net`` from ``arrays[prefix + torch name]`` (a dict or
    an ``np.load`` result). ``num_batches_tracked`` is optional on both sides; any other
    missing, unexpected or wrongly shaped array is a ValueError naming all of them, raised
    before anything changes."""
    state = net.state_dict()
    values = layouts.checked_torch_arrays(
        arrays, prefix, {k: tuple(v.shape) for k, v in state.items()
                         if not k.endswith("num_batches_tracked")})
    net.load_state_dict({**state, **{k: flow.tensor(v, dtype=state[k].dtype)
                                     for k, v in values.items()}})
