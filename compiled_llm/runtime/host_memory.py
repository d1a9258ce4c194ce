"""Pinned host memory that the GPU addresses directly: OmniKV's offloaded KV cache (docs/sparse_kv.md).

`MappedHost.empty` allocates a host tensor, pins it (`cudaHostRegister`, exactly the bytes asked for: the
pinned caching allocator rounds a request up to a power of two) and returns a CUDA tensor over the same
bytes. Under unified addressing a registered host page has the same address on the device, so any kernel
(Triton, Inductor's, torch's) reads and writes it over PCIe as if it were device memory, and CUDA graphs
capture those kernels like any others. A check at allocation writes through the device view and reads
the host copy back. On the CPU the host tensor is the cache itself."""

from __future__ import annotations

import os

import torch

_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class MappedHost:
    """Keeps the host tensors of the device views alive and unregisters the pinned ones on release."""

    def __init__(self):
        self.host: list[torch.Tensor] = []
        self.pinned: list[torch.Tensor] = []  # registered with CUDA (a CUDA device's caches)
        self.bytes = 0

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        host = torch.zeros(shape, dtype=dtype)
        nbytes = host.numel() * host.element_size()
        self.host.append(host)
        self.bytes += nbytes
        if device.type != "cuda":
            return host
        rc = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, _REGISTER_PORTABLE_MAPPED))
        if rc != 0:
            self.host.pop()
            self.bytes -= nbytes
            raise RuntimeError(f"could not pin {nbytes / 2 ** 30:.1f} GiB of host memory for the offloaded KV cache "
                               f"(cudaHostRegister error {rc}); lower omnikv_host_memory_gb or use "
                               "--no-omnikv-offload")
        self.pinned.append(host)
        return device_view(host, device)

    def release(self) -> None:
        if self.pinned:
            torch.cuda.synchronize()
            for h in self.pinned:
                torch.cuda.cudart().cudaHostUnregister(h.data_ptr())
        self.host, self.pinned, self.bytes = [], [], 0


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` over the bytes of `host` (registered pinned memory, for a CUDA device), checked by a
    write through it that the host copy must show."""
    nbytes = host.numel() * host.element_size()
    if device.type == "cuda" and device.index is None:  # a storage names its device by index ("cuda:0")
        device = torch.device("cuda", torch.cuda.current_device())
    storage = torch._C._construct_storage_from_data_pointer(host.data_ptr(), device, nbytes)
    view = torch.empty(0, dtype=host.dtype, device=device).set_(storage, 0, host.shape, host.stride())
    first = host.view(-1)[:1].clone()
    view.view(-1)[:1].fill_(1.0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if host.view(-1)[0].item() != 1.0:
        raise RuntimeError("the device does not address this host memory at its host address (no unified "
                           "addressing); use --no-omnikv-offload")
    host.view(-1)[:1].copy_(first)
    return view
