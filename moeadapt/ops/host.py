"""Host <-> device copies that do not wait for the device, for batches, document boundaries and step statistics.

`x.to("cuda")` from host memory waits until the device has finished everything queued before it (a host sync
that stalls the step's kernel queue); `to_device` sends a pinned, non-blocking copy instead, ordered on the current
stream like any kernel. A packed batch's boundaries (cu_seqlens) are known on the host when the batch is built:
models/documents.py keeps them there, so an op reads their values for free (validation, chunk counts, launch
grids) and sends them to its device this way. A cu_seqlens given on the device still works, at the price of one
device read (a host sync) wherever an op needs its values on the host.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t on `device` (and in `dtype`); a host tensor goes to a CUDA device as a pinned, non-blocking copy, so the
    host does not wait for the device's queue to drain."""
    device = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.device == device or (device.type == t.device.type and device.index is None):
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_host(v):
    """A device tensor copied into pinned host memory without waiting for the device (ordered on the current
    stream: read it after an event recorded later on that stream has passed); host tensors and non-tensors as
    they are."""
    if not isinstance(v, torch.Tensor) or v.device.type == "cpu":
        return v
    out = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
    return out.copy_(v.detach(), non_blocking=True)


def host_tensor(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """torch.tensor(values) made on the host and sent to `device` as `to_device` sends it (torch.tensor(...,
    device="cuda") waits for the device)."""
    return to_device(torch.tensor(values, dtype=dtype), device)
