"""The backbone registry: families register their builders here by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn


@dataclass(frozen=True)
class BackboneSpec:
    name: str
    task: str
    """``face`` builders map images to embeddings; ``classification`` builders to logits."""
    build: Callable[..., nn.Module]


_REGISTRY: dict[str, BackboneSpec] = {}


def register(name: str, task: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _REGISTRY:
            raise RuntimeError(f"backbone {name!r} registered twice")
        _REGISTRY[name] = BackboneSpec(name, task, fn)
        return fn

    return wrap


def backbone_names() -> list[str]:
    return sorted(_REGISTRY)


def get_spec(name: str) -> BackboneSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backbone {name!r}; known: {', '.join(backbone_names())}") from None


def build_backbone(name: str, **kwargs) -> nn.Module:
    """Build a registered backbone. Face backbones take embedding_size, input_size, output_block,
    dropout; classification backbones take num_classes."""
    return get_spec(name).build(**kwargs)


def workload_backbone(workload) -> nn.Module:
    """The backbone a ``Workload`` trains (freshly initialised from torch's global seed)."""
    return build_backbone(workload.backbone, embedding_size=workload.embedding_size,
                          num_classes=workload.num_classes, input_size=workload.input_size,
                          output_block=workload.output_block, dropout=workload.dropout)
