import torch

from monokernel.kernels.schedule import handoff_round


def test_handoff_round_keeps_16_mantissa_bits_and_rounds_to_nearest() -> None:
    g = torch.Generator().manual_seed(0)
    v = torch.randn(10_001, generator=g) * torch.logspace(-20, 20, 10_001)
    r = handoff_round(v)
    bits = r.view(torch.int32)
    assert bool(((bits & 0xFF) == 0).all()), "the tag byte must come back clear"
    rel = ((r - v).abs() / v.abs()).max().item()
    assert rel <= 2.0**-16, rel  # half a unit in the last of 16 significant bits
    assert bool((torch.sign(r) == torch.sign(v)).all())


def test_handoff_round_is_exact_on_bf16_values_and_rounds_half_up_in_magnitude() -> None:
    b = torch.randn(4097, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    assert torch.equal(handoff_round(b), b)  # an embedding row passes through unchanged
    one = torch.tensor([1.0, -1.0])
    ulp = 2.0**-15  # 16 significant bits -> spacing 2^-15 at 1.0
    assert torch.equal(handoff_round(one + ulp * 0.49 * torch.sign(one)), one)
    assert torch.equal(
        handoff_round(one + ulp * 0.5 * torch.sign(one)), one + ulp * torch.sign(one)
    )
