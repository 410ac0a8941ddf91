"""The vision tower: ViT over variable-resolution images -> 2 x 2 patch merger -> MLP projector.

Owns: `ImageBatch` (the packed pixel input), `VisionTower` (patch embedding + pre-LN ViT blocks with 2-D
rotary positions, block-diagonal attention by cu_seqlens), `PatchMerger`, `Projector` and `VisionModel`, which
also replaces a text's image placeholder tokens by the projected image tokens. Must not know about the language
model's blocks: it returns (or inserts) vectors of the LM's hidden size, nothing more.

Shape suffixes: N patches (all images), M merged tokens (= N / 4), D vision width, H heads, Dh head dim,
P = channels x patch x patch pixel values per patch, I images.

Patch order (the data pipeline writes it, data/multimodal.py `patchify`): image by image; inside an image,
merged 2 x 2 blocks in raster order, and inside a block its 4 patches in raster order. The merger therefore
concatenates 4 consecutive patches, and a patch's (row, col) follows from its image's grid alone.

Layout options of onboarded towers (VisionSpec; defaults = the tower above), e.g. MoonViT (Kimi K2.5): a learned
absolute position table resampled bicubically to each image's grid (`pos_embed_grid`), the tanh GELU in the
blocks (`mlp_act`), the merger's own LayerNorm epsilon (`merger_norm_eps`), a Conv2d-shaped patch embedding
weight (`patch_embed_conv`); or GLM-5.3's: RMSNorms (`norm`), per-head q / k RMSNorm (`qk_norm`), clamped SwiGLU
MLPs (`mlp_act`, `swiglu_limit`), a Conv3d patch kernel over repeated frames (`temporal_patch_size`), the
downsample + SwiGLU projector (`projector: glm`). Other RoPE layouts need no option: the name map permutes q / k
rows (and q / k norm weights) onto ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...config import VisionSpec
from ..common import RMSNorm
from .attention import packed_attention


def _norm(spec: VisionSpec, dim: int) -> nn.Module:
    return RMSNorm(dim, eps=spec.norm_eps) if spec.norm == "rmsnorm" else nn.LayerNorm(dim, eps=spec.norm_eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SiLU(gate) * up, with GLM's clamps (gate <= limit, |up| <= limit) when `limit` is set."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


@dataclass
class ImageBatch:
    """Images of one batch, packed: pixel_values [N, P] (patches in the order above), grid_hw [I, 2] int64
    (patch rows, patch cols per image), in the order the images' placeholders appear in the batch's rows."""

    pixel_values: torch.Tensor
    grid_hw: torch.Tensor

    @property
    def n_tokens(self) -> int:  # merged tokens = placeholders the images fill
        return int((self.grid_hw[:, 0] * self.grid_hw[:, 1]).sum()) // 4

    def to(self, device) -> ImageBatch:
        return ImageBatch(self.pixel_values.to(device), self.grid_hw.to(device))

    @staticmethod
    def cat(batches: list[ImageBatch | None]) -> ImageBatch | None:
        bs = [b for b in batches if b is not None and b.grid_hw.shape[0]]
        if not bs:
            return None
        return ImageBatch(torch.cat([b.pixel_values for b in bs]), torch.cat([b.grid_hw for b in bs]))


def patchify(image_CHW: torch.Tensor, patch: int, merge: int = 2) -> torch.Tensor:
    """One image [C, H, W] (H, W multiples of patch * merge) -> its patches [N, C * patch * patch] in the packed
    order: merged blocks in raster order, then the merge x merge patches of a block in raster order."""
    C, H, W = image_CHW.shape
    gh, gw = H // patch, W // patch
    if gh * patch != H or gw * patch != W or gh % merge or gw % merge:
        raise ValueError(f"image of {H} x {W} pixels is not a multiple of patch_size * merge_size = "
                         f"{patch * merge}; resize it first (data/multimodal.py resize_for_budget)")
    x = image_CHW.reshape(C, gh // merge, merge, patch, gw // merge, merge, patch)
    return x.permute(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, C * patch * patch)


def patch_positions(grid_hw: torch.Tensor, merge: int = 2) -> torch.Tensor:
    """(row, col) of every patch [N, 2] in the packed order (merged blocks in raster order, then patches)."""
    out = []
    for h, w in grid_hw.tolist():
        r = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        c = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        out.append(torch.stack([r.permute(0, 2, 1, 3).reshape(-1), c.permute(0, 2, 1, 3).reshape(-1)], -1))
    return torch.cat(out, 0)


def rope_2d(pos_N2: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, head_dim / 2]: the first half of the head dim rotates by the patch row, the second by the
    column, each half in the half-split convention with theta^(-2i / (head_dim / 2)) frequencies."""
    quarter = head_dim // 4
    inv = 1.0 / theta ** (torch.arange(quarter, dtype=torch.float64) * 2 / (head_dim // 2))
    ang = torch.cat([pos_N2[:, :1].double() * inv, pos_N2[:, 1:].double() * inv], -1)  # [N, 2 * quarter]
    return ang.cos(), ang.sin()


def apply_rope_2d(x_NHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q = x_NHD.shape[-1] // 4
    xf = x_NHD if x_NHD.dtype == torch.float64 else x_NHD.float()
    c, s = cos[:, None].to(xf.dtype), sin[:, None].to(xf.dtype)
    parts = []
    for j in range(2):  # row half, column half
        x1, x2 = xf[..., 2 * j * q:(2 * j + 1) * q], xf[..., (2 * j + 1) * q:(2 * j + 2) * q]
        cj, sj = c[..., j * q:(j + 1) * q], s[..., j * q:(j + 1) * q]
        parts += [x1 * cj - x2 * sj, x1 * sj + x2 * cj]
    return torch.cat(parts, -1).to(x_NHD.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, qk_norm: bool = False, eps: float = 1e-6):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(dim // n_heads, eps), RMSNorm(dim // n_heads, eps)
        self.qk_norm = qk_norm
        self.backend = "auto"

    def forward(self, x_ND: torch.Tensor, cos, sin, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
        N, D = x_ND.shape
        q, k, v = self.qkv(x_ND).view(N, 3, self.n_heads, D // self.n_heads).unbind(1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        backend = "auto" if self.backend == "triton" else self.backend  # the model-wide switch has no ViT kernel
        o = packed_attention(q, k, v, cu_seqlens, max_len, backend)
        return self.proj(o.reshape(N, D))


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        d = spec.hidden_size
        self.spec = spec
        self.approximate = "tanh" if spec.mlp_act == "gelu_tanh" else "none"
        self.norm1 = _norm(spec, d)
        self.attn = VisionAttention(d, spec.n_heads, spec.qk_norm, spec.norm_eps)
        self.norm2 = _norm(spec, d)
        self.fc1 = nn.Linear(d, spec.intermediate_size, bias=True)
        if spec.mlp_act == "swiglu":  # fc1 = gate, fc3 = up
            self.fc3 = nn.Linear(d, spec.intermediate_size, bias=True)
        self.fc2 = nn.Linear(spec.intermediate_size, d, bias=True)

    def forward(self, x_ND, cos, sin, cu_seqlens, max_len):
        x_ND = x_ND + self.attn(self.norm1(x_ND), cos, sin, cu_seqlens, max_len)
        h = self.norm2(x_ND)
        if self.spec.mlp_act == "swiglu":
            return x_ND + self.fc2(swiglu(self.fc1(h), self.fc3(h), self.spec.swiglu_limit))
        return x_ND + self.fc2(F.gelu(self.fc1(h), approximate=self.approximate))


class ConvPatchEmbed(nn.Module):
    """The patch embedding with its weight kept as a Conv2d kernel [D, C, p, p] (how MoonViT stores it), or a
    Conv3d one [D, C, T, p, p] (GLM: an image is repeated over the T frames, so the frames' kernels add up): on
    patches [N, C * p * p] it is the linear map with the (frame-summed) kernel flattened."""

    def __init__(self, in_channels: int, patch: int, dim: int, frames: int = 1):
        super().__init__()
        shape = (dim, in_channels, frames, patch, patch) if frames > 1 else (dim, in_channels, patch, patch)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, px_NP: torch.Tensor) -> torch.Tensor:
        w = self.weight.sum(2) if self.weight.dim() == 5 else self.weight
        return F.linear(px_NP, w.flatten(1), self.bias)


def resample_pos_embed(table_hwD: torch.Tensor, grid_hw: torch.Tensor, merge: int = 2) -> torch.Tensor:
    """A learned [h, w, D] position table resampled to each image's patch grid (bicubic, align_corners=False,
    edge rows repeated: F.interpolate's convention; the table itself where the sizes agree) -> [N, D] in the
    packed patch order."""
    out = []
    table = table_hwD.permute(2, 0, 1).unsqueeze(0)  # [1, D, h, w]
    for (gh, gw), pos in zip(grid_hw.tolist(), patch_positions(grid_hw, merge).split(
            (grid_hw[:, 0] * grid_hw[:, 1]).tolist())):
        t = table if tuple(table.shape[2:]) == (gh, gw) else F.interpolate(
            table, size=(gh, gw), mode="bicubic", align_corners=False)
        out.append(t[0, :, pos[:, 0], pos[:, 1]].T)
    return torch.cat(out, 0)


class VisionTower(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        p = spec.patch_size
        if spec.patch_embed_conv:
            self.patch_embed = ConvPatchEmbed(spec.in_channels, p, spec.hidden_size, spec.temporal_patch_size)
        else:
            self.patch_embed = nn.Linear(spec.in_channels * p * p, spec.hidden_size, bias=True)
        if spec.pos_embed_grid is not None:
            self.pos_embed = nn.Parameter(torch.empty(*spec.pos_embed_grid, spec.hidden_size))
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.n_layers))
        self.norm = _norm(spec, spec.hidden_size)

    def forward(self, images: ImageBatch) -> torch.Tensor:
        """-> patch features [N, D] in the packed order."""
        s, px, grid = self.spec, images.pixel_values, images.grid_hw.cpu()
        n_pix = s.in_channels * s.patch_size ** 2
        if px.dim() != 2 or px.shape[1] != n_pix:
            raise ValueError(f"pixel_values has shape {tuple(px.shape)}; expected [patches, {n_pix}] "
                             f"({s.in_channels} channels x {s.patch_size} x {s.patch_size})")
        if grid.numel() and bool((grid % s.merge_size).any()):
            raise ValueError(f"image grids {grid.tolist()} must be multiples of merge_size={s.merge_size} patches; "
                             "resize images to multiples of patch_size * merge_size pixels")
        lens = grid[:, 0] * grid[:, 1]
        if int(lens.sum()) != px.shape[0]:
            raise ValueError(f"image grids hold {int(lens.sum())} patches but pixel_values has {px.shape[0]} rows")
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        cos, sin = rope_2d(patch_positions(grid, s.merge_size), s.hidden_size // s.n_heads, s.rope_theta)
        cos, sin = cos.to(px.device), sin.to(px.device)
        x = self.patch_embed(px.to(self.patch_embed.weight.dtype))
        if s.pos_embed_grid is not None:
            x = x + resample_pos_embed(self.pos_embed, grid, s.merge_size).to(x.dtype)
        max_len = int(lens.max())
        for blk in self.blocks:
            x = blk(x, cos, sin, cu, max_len)
        return self.norm(x)


class PatchMerger(nn.Module):
    """LayerNorm per patch (not for the glm projector), then the 4 patches of each 2 x 2 block concatenated:
    [N, D] -> [N / 4, 4 D]."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        if spec.projector == "mlp":
            self.norm = nn.LayerNorm(spec.hidden_size, eps=spec.merger_norm_eps or spec.norm_eps)
        self.group = spec.merge_size ** 2

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        x = self.norm(x_ND) if hasattr(self, "norm") else x_ND
        return x.reshape(-1, self.group * x_ND.shape[-1])


class Projector(nn.Module):
    """MLP into the language model: fc2(GELU(fc1(x))), [M, 4 D] -> [M, lm_hidden]."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden, bias=True)
        self.fc2 = nn.Linear(hidden, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GLMProjector(nn.Module):
    """GLM-5.3's: downsample (a linear 4 D -> out stored as its Conv2d kernel [out, D, 2, 2]: our merged vector
    is the 2 x 2 block's patches in raster order, each D wide), proj, LayerNorm, GELU, then the SwiGLU
    fc2(SiLU(fc1 x) * fc3 x) through `hidden` (clamped by `limit`). [M, 4 D] -> [M, out]."""

    def __init__(self, dim: int, hidden: int, out_dim: int, limit: float | None, merge: int = 2):
        super().__init__()
        self.downsample = ConvPatchEmbed(dim, merge, out_dim)  # the same stored-as-kernel linear map, permuted
        self.proj = nn.Linear(out_dim, out_dim, bias=False)
        self.norm = nn.LayerNorm(out_dim, eps=1e-5)
        self.fc1 = nn.Linear(out_dim, hidden, bias=False)
        self.fc3 = nn.Linear(out_dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, out_dim, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.downsample.weight  # [out, D, kh, kw] -> [out, (kh, kw, D)]
        h = F.linear(x, w.permute(0, 2, 3, 1).flatten(1), self.downsample.bias)
        h = F.gelu(self.norm(self.proj(h)))
        return self.fc2(swiglu(self.fc1(h), self.fc3(h), self.limit))


class VisionModel(nn.Module):
    """tower -> merger -> projector, and the placeholder replacement (`embed_images`)."""

    def __init__(self, spec: VisionSpec, lm_hidden: int):
        super().__init__()
        self.spec = spec
        self.tower = VisionTower(spec)
        self.merger = PatchMerger(spec)
        d4 = spec.hidden_size * spec.merge_size ** 2
        if spec.projector == "glm":
            self.projector = GLMProjector(spec.hidden_size, spec.projector_hidden_size or lm_hidden, lm_hidden,
                                          spec.swiglu_limit, spec.merge_size)
        else:
            self.projector = Projector(d4, spec.projector_hidden_size or lm_hidden, lm_hidden)

    def forward(self, images: ImageBatch) -> torch.Tensor:
        """-> image tokens [M, lm_hidden], image by image in the packed order."""
        return self.projector(self.merger(self.tower(images)))

    def _dummy(self, device) -> ImageBatch:
        p = self.spec.patch_size
        return ImageBatch(torch.zeros(4, self.spec.in_channels * p * p, device=device),
                          torch.tensor([[2, 2]], dtype=torch.long))

    def embed_images(self, x_BTD: torch.Tensor, input_ids: torch.Tensor, images: ImageBatch | None) -> torch.Tensor:
        """Replace the embeddings of the image placeholder tokens by the projected image tokens, in order.

        Without images the tower still runs once on a 2 x 2-patch blank (its output multiplied by zero): every
        rank then runs the same FSDP unit and every trainable vision parameter gets a (zero) gradient."""
        is_img = input_ids == self.spec.image_token_id
        n_slots = int(is_img.sum())
        if images is None or images.grid_hw.shape[0] == 0:
            if n_slots:
                raise ValueError(f"the text holds {n_slots} image placeholder tokens "
                                 f"(id {self.spec.image_token_id}) but no images were given")
            return x_BTD + 0.0 * self(self._dummy(x_BTD.device)).sum().to(x_BTD.dtype)
        if images.n_tokens != n_slots:
            raise ValueError(f"the images give {images.n_tokens} tokens but the text holds {n_slots} image "
                             f"placeholders (id {self.spec.image_token_id}); each image needs "
                             "(H / patch / 2) * (W / patch / 2) placeholders, as data/multimodal.py writes them")
        tok_MD = self(images).to(x_BTD.dtype)
        return x_BTD.masked_scatter(is_img.unsqueeze(-1), tok_MD)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, ConvPatchEmbed)):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:  # the glm projector's linears have none
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if self.spec.pos_embed_grid is not None:
            nn.init.normal_(self.tower.pos_embed, std=std)
