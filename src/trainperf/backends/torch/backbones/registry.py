"""The torch backbones by name: every entry of ``backends.catalog`` whose family this backend
declares, built by the builder its family module registers (``@family("iresnet")``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch.nn as nn

from ... import catalog
from ..backend import BACKEND

FamilyBuilder = Callable[..., nn.Module]
"""``(catalogue entry, **build arguments) -> module``; arguments the family does not use are
ignored."""

CATALOG = catalog.BackendCatalog(BACKEND.capabilities.families, BACKEND.name)
backbone_names = CATALOG.names
_BUILDERS: dict[str, FamilyBuilder] = {}


@dataclass(frozen=True)
class BackboneSpec:
    name: str
    task: str
    """``face`` builders map images to embeddings; ``classification`` builders to logits."""
    build: Callable[..., nn.Module]


def family(name: str) -> Callable[[FamilyBuilder], FamilyBuilder]:
    """Register the builder of the catalogue family ``name``."""
    def wrap(fn: FamilyBuilder) -> FamilyBuilder:
        if name in _BUILDERS:
            raise RuntimeError(f"backbone family {name!r} registered twice")
        _BUILDERS[name] = fn
        return fn

    return wrap


def get_spec(name: str) -> BackboneSpec:
    entry = CATALOG.lookup(name)
    return BackboneSpec(name, entry.task, partial(_build, entry))


def _build(entry: catalog.Backbone, *, embedding_size: int | None = None,
           num_classes: int | None = None, **kwargs: object) -> nn.Module:
    return _BUILDERS[entry.family](entry, embedding_size=entry.embedding(embedding_size),
                                   num_classes=entry.classes(num_classes), **kwargs)


def build_backbone(name: str, **kwargs) -> nn.Module:
    """Build a backbone of the catalogue. Face backbones take embedding_size, input_size,
    output_block, dropout; classification backbones take num_classes. None or nothing: the
    catalogue's default."""
    return get_spec(name).build(**kwargs)


def workload_backbone(workload) -> nn.Module:
    """The backbone a ``Workload`` trains (freshly initialised from torch's global seed)."""
    return build_backbone(workload.backbone, embedding_size=workload.embedding_size,
                          num_classes=workload.num_classes, input_size=workload.input_size,
                          output_block=workload.output_block, dropout=workload.dropout)
