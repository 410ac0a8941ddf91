"""The vision model's math, written out for one image at a time: the specification the packed module is
tested against (float64, values and gradients). Nothing here is used at run time.

An image [C, H, W] is cut into patches in plain raster order; positions are (row, col); 2-D RoPE rotates the
pair (x[i], x[i + Dh/4]) of the row half (and of the column half, offset Dh/2) as the complex number
x[i] + j x[i + Dh/4] times exp(j pos theta^(-2i / (Dh/2))); attention is softmax over all patches of the image;
the merger concatenates the 2 x 2 spatial neighbours (r, c), (r, c+1), (r+1, c), (r+1, c+1) of each block.
Options (VisionSpec): a learned position table [h, w, D] resampled to the image's grid by the separable Keys
cubic kernel (a = -0.75) at half-pixel centres, edge rows repeated, and added after the patch embedding; the
tanh GELU in the blocks; the merger's own LayerNorm epsilon; a Conv2d-shaped patch embedding (flattened); GLM's
RMSNorms, per-head q / k RMSNorm, clamped SwiGLU MLPs, Conv3d patch kernel (frames summed: an image fills
them all) and its projector (a 2 x 2 stride-2 convolution, proj, LayerNorm, GELU, clamped SwiGLU).
"""

from __future__ import annotations

import math

import torch


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _cubic_matrix(n_out: int, n_in: int) -> torch.Tensor:
    """[n_out, n_in]: output i = sum_k w_k(i) in[clamp(floor(s) - 1 + k)], s = (i + 0.5) n_in / n_out - 0.5, Keys'
    kernel with a = -0.75 at the distance |s - tap|."""
    a = -0.75
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        s = (i + 0.5) * n_in / n_out - 0.5
        f = math.floor(s)
        for tap in range(f - 1, f + 3):
            d = abs(s - tap)
            w = ((a + 2) * d - (a + 3)) * d * d + 1 if d <= 1 else ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
            m[i, min(max(tap, 0), n_in - 1)] += w
    return m


def resample_reference(table_hwD: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """The position table [h, w, D] at an image's grid [gh, gw, D] (bicubic, align_corners=False)."""
    h, w, _ = table_hwD.shape
    rows, cols = _cubic_matrix(gh, h).to(table_hwD.dtype), _cubic_matrix(gw, w).to(table_hwD.dtype)
    return torch.einsum("ia,abd,jb->ijd", rows, table_hwD, cols)


def _rope(x_NHD, rows, cols, theta):
    dh = x_NHD.shape[-1]
    q = dh // 4
    freq = theta ** (-2 * torch.arange(q, dtype=torch.float64) / (dh // 2))
    out = x_NHD.clone()
    for half, pos in ((0, rows), (1, cols)):
        lo = half * dh // 2
        z = torch.complex(x_NHD[..., lo:lo + q], x_NHD[..., lo + q:lo + 2 * q])
        rot = torch.polar(torch.ones_like(freq), pos.double()[:, None] * freq)[:, None, :]  # [N, 1, q]
        z = z * rot
        out = torch.cat([out[..., :lo], z.real, z.imag, out[..., lo + 2 * q:]], -1)
    return out


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _swiglu(gate, up, limit):
    if limit is not None:
        gate, up = torch.minimum(gate, torch.tensor(limit, dtype=gate.dtype)), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate) * up


def _lin(p, name, x):
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if name + ".bias" in p else y


def vision_reference(p: dict[str, torch.Tensor], spec, image_CHW: torch.Tensor) -> torch.Tensor:
    """p: the VisionModel's named parameters; -> image tokens [(H/2p) * (W/2p), lm_hidden] in raster order
    of the merged blocks."""
    ps, nh, eps = spec.patch_size, spec.n_heads, spec.norm_eps
    C, H, W = image_CHW.shape
    gh, gw = H // ps, W // ps
    patches = image_CHW.reshape(C, gh, ps, gw, ps).permute(1, 3, 0, 2, 4).reshape(gh * gw, C * ps * ps)
    idx = torch.arange(gh * gw)
    rows, cols = idx // gw, idx % gw
    w = p["tower.patch_embed.weight"]
    if spec.temporal_patch_size > 1:  # [D, C, T, p, p] on T copies of the image: the frames' kernels add up
        w = sum(w[:, :, t] for t in range(spec.temporal_patch_size))
    x = patches @ w.flatten(1).T + p["tower.patch_embed.bias"]
    N, D = x.shape
    if spec.pos_embed_grid is not None:
        x = x + resample_reference(p["tower.pos_embed"], gh, gw).reshape(N, D)
    act = _gelu_tanh if spec.mlp_act == "gelu_tanh" else _gelu

    def norm(x, name):
        if spec.norm == "rmsnorm":
            return _rms(x, p[name + ".weight"], eps)
        return _ln(x, p[name + ".weight"], p[name + ".bias"], eps)

    for i in range(spec.n_layers):
        b = f"tower.blocks.{i}."
        h = norm(x, b + "norm1")
        q, k, v = _lin(p, b + "attn.qkv", h).view(N, 3, nh, D // nh).unbind(1)
        if spec.qk_norm:
            q, k = _rms(q, p[b + "attn.q_norm.weight"], eps), _rms(k, p[b + "attn.k_norm.weight"], eps)
        q, k = _rope(q, rows, cols, spec.rope_theta), _rope(k, rows, cols, spec.rope_theta)
        s = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(D // nh)
        a = torch.exp(s - s.amax(-1, keepdim=True))
        a = a / a.sum(-1, keepdim=True)
        o = torch.einsum("hnm,mhd->nhd", a, v).reshape(N, D)
        x = x + _lin(p, b + "attn.proj", o)
        h = norm(x, b + "norm2")
        if spec.mlp_act == "swiglu":
            x = x + _lin(p, b + "fc2", _swiglu(_lin(p, b + "fc1", h), _lin(p, b + "fc3", h), spec.swiglu_limit))
        else:
            x = x + _lin(p, b + "fc2", act(_lin(p, b + "fc1", h)))
    x = norm(x, "tower.norm")
    if spec.projector == "mlp":
        x = _ln(x, p["merger.norm.weight"], p["merger.norm.bias"], spec.merger_norm_eps or eps)
    x = x.view(gh, gw, D)
    if spec.projector == "glm":  # a 2 x 2 convolution with stride 2, then proj, LayerNorm, GELU, SwiGLU
        k = p["projector.downsample.weight"]  # [out, D, 2, 2]
        h = sum(torch.einsum("ijd,od->ijo", x[r::2, c::2], k[:, :, r, c]) for r in (0, 1) for c in (0, 1))
        h = h.reshape(-1, k.shape[0]) + p["projector.downsample.bias"]
        h = _lin(p, "projector.proj", h)
        h = _gelu(_ln(h, p["projector.norm.weight"], p["projector.norm.bias"], 1e-5))
        return _lin(p, "projector.fc2", _swiglu(_lin(p, "projector.fc1", h), _lin(p, "projector.fc3", h),
                                                  spec.swiglu_limit))
    merged = torch.cat([x[0::2, 0::2], x[0::2, 1::2], x[1::2, 0::2], x[1::2, 1::2]], -1).reshape(-1, 4 * D)
    return _lin(p, "projector.fc2", _gelu(_lin(p, "projector.fc1", merged)))
