"""Named workloads, aligned with the DLPerf InsightFace / ResNet50 / PLSC reports."""

from __future__ import annotations

from dataclasses import dataclass

from .config import Workload


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    workload: Workload
    reference_model: str | None = None
    """The model's key in DLPerf's tables and JSON exports (``r100``, ``y1``, ``r50``, ``rn50``)."""
    reference_mode: str = ""
    """Key=value pairs that a published row's mode must contain to be comparable."""


EMORE = 85742
GLINT360K = 360232

_RECIPES = [
    Recipe(
        "r100-arcface-emore",
        "IResNet-100, output block E, ArcFace, face_emore classes, batch 64",
        Workload(backbone="iresnet100", num_classes=EMORE, batch_size=64, embedding_size=512,
                 output_block="E", loss="arcface", lr_steps=(100_000, 160_000),
                 lr_scales=(0.1, 0.01)),
        "r100", "dataset=face_emore;loss=arcface",
    ),
    Recipe(
        "r100-cosface-glint360k",
        "IResNet-100, output block FC, CosFace, glint360k classes, batch 64",
        Workload(backbone="iresnet100", num_classes=GLINT360K, batch_size=64, embedding_size=512,
                 output_block="FC", loss="cosface",
                 lr_steps=(200_000, 400_000, 500_000, 550_000),
                 lr_scales=(0.1, 0.01, 0.001, 0.0001)),
        "r100", "dataset=glint360k;loss=cosface",
    ),
    Recipe(
        "y1-arcface-emore",
        "MobileFaceNet Y1 (GDC, 128-d), ArcFace, face_emore classes, batch 256",
        Workload(backbone="mobilefacenet_y1", num_classes=EMORE, batch_size=256,
                 embedding_size=128, loss="arcface", lr_steps=(100_000, 160_000, 220_000),
                 lr_scales=(0.1, 0.01, 0.001)),
        "y1", "dataset=face_emore;loss=arcface",
    ),
    Recipe(
        "r50-arcface-plsc",
        "PLSC's ResNet50: IResNet-50's layout with output block E, ArcFace, batch 128",
        Workload(backbone="iresnet50", num_classes=EMORE, batch_size=128, embedding_size=512,
                 output_block="E", loss="arcface", lr_steps=(100_000, 140_000, 160_000),
                 lr_scales=(0.1, 0.01, 0.001)),
        "r50", "framework=paddle",
    ),
    Recipe(
        "rn50-v1b-imagenet",
        "ResNet50 v1b (stride on the 3x3), 224x224, 1000-way softmax, batch 128",
        Workload(backbone="resnet50_v1b", task="classification", num_classes=1000,
                 batch_size=128, input_size=224, loss="softmax", weight_decay=1e-4,
                 clip_grad_norm=None),
        "rn50", "",
    ),
    Recipe(
        "tiny-arcface",
        "A tiny IResNet (64-d), ArcFace, 1000 classes, batch 8: for tests and CPU smoke runs",
        Workload(backbone="iresnet_tiny", num_classes=1000, batch_size=8, embedding_size=64,
                 output_block="E", loss="arcface"),
    ),
    Recipe(
        "rn50-v1b-64px",
        "ResNet50 v1b at 64x64 (all its layers and 102 MB of gradients), batch 8: a ResNet50 "
        "step one CPU core runs in about half a second",
        Workload(backbone="resnet50_v1b", task="classification", num_classes=1000,
                 batch_size=8, input_size=64, loss="softmax", weight_decay=1e-4,
                 clip_grad_norm=None),
    ),
]

RECIPES: dict[str, Recipe] = {r.name: r for r in _RECIPES}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; `trainperf list` shows them: "
                         f"{', '.join(RECIPES)}") from None
