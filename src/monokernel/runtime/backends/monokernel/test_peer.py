"""Multicast stays off; peer access between the GPUs of one process (gpu)."""

from __future__ import annotations

import os

import pytest
import torch

from monokernel.runtime.backends.monokernel import peer

needs_2_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


def test_multicast_off_sets_every_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in peer.MULTICAST_OFF_ENV:
        monkeypatch.setenv(k, "1" if k == "NCCL_NVLS_ENABLE" else "0")  # the wrong way round
    peer.multicast_off()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"


@pytest.mark.gpu
@needs_2_gpus
def test_enable_peer_access_is_idempotent() -> None:
    assert peer.can_access_peer(0, 1) and peer.can_access_peer(1, 0), (
        "GPUs 0 and 1 have no peer-to-peer path: the in-kernel all-reduce cannot run here"
    )
    peer.enable_peer_access([0, 1])
    peer.enable_peer_access([0, 1])  # already enabled: no error
    # torch sees the pair too, and a copy between them works after enabling.
    x = torch.arange(1000.0, device="cuda:0")
    assert torch.equal(x.to("cuda:1").cpu(), x.cpu())


@pytest.mark.gpu
def test_device_buffer_alloc_and_free() -> None:
    buf = peer.DeviceBuffer(0, 1 << 20)
    assert buf.ptr and buf.ptr % 256 == 0
    buf.free()
    buf.free()  # twice is harmless
    assert buf.ptr == 0
