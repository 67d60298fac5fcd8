"""The backbones trainperf knows, by name: one table every backend builds from (standard library
only, so any framework's worker imports it).

Each entry names its family and the family's architecture, and the defaults a builder takes
when a workload leaves them unset. A backend builds whole families (``Capabilities.families``):
every size of a family it builds is there, so what a backend runs never disagrees with what its
models build. The defaults are torch's, which every other backend's builders match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("iresnet", "mobilefacenet", "resnet_v1b")
IRESNET_WIDTHS = (64, 128, 256, 512)
IRESNET_LAYERS = {
    "iresnet18": (2, 2, 2, 2),
    "iresnet34": (3, 4, 6, 3),
    "iresnet50": (3, 4, 14, 3),
    "iresnet100": (3, 13, 30, 3),
    "iresnet200": (6, 26, 60, 6),
}


@dataclass(frozen=True)
class Backbone:
    name: str
    family: str
    """``iresnet``, ``mobilefacenet`` or ``resnet_v1b``."""
    task: str
    """``face`` (images -> embeddings) or ``classification`` (images -> logits)."""
    arch: dict[str, Any] = field(default_factory=dict)
    """The family builder's architecture arguments: ``layers`` and ``widths`` (IResNet);
    ``width``, ``blocks``, ``sep_channels``, ``hidden`` (MobileFaceNet; absent: the family's
    defaults); ``layers`` and ``base_width`` (ResNet v1b)."""
    default_embedding: int | None = None
    """Face: the embedding width when a workload gives none."""
    default_classes: int | None = None
    """Classification: the class count when a workload gives none."""

    def embedding(self, given: int | None) -> int | None:
        """The embedding width to build: ``given``, or the default when it is None."""
        return self.default_embedding if given is None else given

    def classes(self, given: int | None) -> int | None:
        """The class count to build: ``given``, or the default when it is None."""
        return self.default_classes if given is None else given


def _iresnet(name: str, layers: tuple[int, ...], widths: tuple[int, ...] = IRESNET_WIDTHS
             ) -> Backbone:
    return Backbone(name, "iresnet", "face", {"layers": layers, "widths": widths}, 512)


BACKBONES: dict[str, Backbone] = {b.name: b for b in (
    *(_iresnet(name, layers) for name, layers in IRESNET_LAYERS.items()),
    _iresnet("iresnet_tiny", (1, 1, 1, 1), (8, 16, 32, 64)),
    Backbone("mobilefacenet_y1", "mobilefacenet", "face", {"width": 1}, 128),
    Backbone("mobilefacenet", "mobilefacenet", "face", {"width": 2}, 512),
    Backbone("mobilefacenet_tiny", "mobilefacenet", "face",
             {"width": 1, "blocks": (1, 1, 1), "sep_channels": 128, "hidden": (32, 64, 64, 64)},
             64),
    Backbone("resnet50_v1b", "resnet_v1b", "classification",
             {"layers": (3, 4, 6, 3), "base_width": 64}, default_classes=1000),
    Backbone("resnet_v1b_tiny", "resnet_v1b", "classification",
             {"layers": (1, 1, 1, 1), "base_width": 8}, default_classes=10),
)}


def names(families: tuple[str, ...] = FAMILIES) -> list[str]:
    """Every backbone of these families, sorted."""
    return sorted(n for n, b in BACKBONES.items() if b.family in families)


def lookup(name: str, families: tuple[str, ...] = FAMILIES, framework: str | None = None
           ) -> Backbone:
    """The entry of ``name``; ValueError naming what the backend (``framework``) builds when
    it is unknown or of a family the backend does not build."""
    entry = BACKBONES.get(name)
    if entry is None or entry.family not in families:
        who = f"the {framework} backend" if framework else "trainperf"
        raise ValueError(f"{who} has no backbone {name!r}; it builds {', '.join(names(families))}")
    return entry


@dataclass(frozen=True)
class BackendCatalog:
    """The part of the catalogue one backend builds: every backbone of ``families`` (its
    ``Capabilities.families``), its errors naming the backend (``framework``)."""

    families: tuple[str, ...]
    framework: str

    def names(self) -> list[str]:
        """Every backbone the backend builds, sorted."""
        return names(self.families)

    def lookup(self, name: str) -> Backbone:
        """The entry of ``name``; ValueError naming what the backend builds when it has none."""
        return lookup(name, self.families, self.framework)

    def task(self, name: str) -> str:
        """``face`` (images -> embeddings) or ``classification`` (images -> logits)."""
        return self.lookup(name).task
