"""Roofline: bytes per decoded token and the bandwidth ceiling on batch-1 tokens/s."""

from monokernel.roofline.calc import (
    KVShape,
    ModelProfile,
    ModelShape,
    Precision,
    Roofline,
    RooflineInputs,
    roofline,
)

__all__ = [
    "KVShape",
    "ModelProfile",
    "ModelShape",
    "Precision",
    "Roofline",
    "RooflineInputs",
    "roofline",
]
