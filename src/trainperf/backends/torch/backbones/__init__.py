"""Backbones registered by name; every family has a tiny variant for tests."""

from __future__ import annotations

# Importing the families registers them.
from . import iresnet, mobilefacenet, resnet_v1b  # noqa: F401
from .registry import (BackboneSpec, backbone_names, build_backbone, get_spec, register,
                       workload_backbone)

__all__ = ["BackboneSpec", "backbone_names", "build_backbone", "get_spec", "register",
           "workload_backbone"]
