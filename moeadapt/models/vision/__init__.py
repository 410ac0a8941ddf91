"""Vision encoder of a vision-language model (DESIGN.md §3): ViT -> 2 x 2 patch merger -> MLP projector."""

from .attention import packed_attention
from .tower import ImageBatch, VisionModel, VisionTower, patch_positions, patchify

__all__ = ["ImageBatch", "VisionModel", "VisionTower", "packed_attention", "patch_positions", "patchify"]
