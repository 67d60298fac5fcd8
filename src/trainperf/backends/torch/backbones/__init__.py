"""The catalogue's backbones (``backends.catalog``) built in torch; every family has a tiny
variant for tests."""

from __future__ import annotations

# Importing the families registers their builders.
from . import iresnet, mobilefacenet, resnet_v1b  # noqa: F401
from .registry import (BackboneSpec, backbone_names, build_backbone, family, get_spec,
                       workload_backbone)

__all__ = ["BackboneSpec", "backbone_names", "build_backbone", "family", "get_spec",
           "workload_backbone"]
