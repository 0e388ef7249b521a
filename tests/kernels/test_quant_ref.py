"""The torch reference math of the packed formats (``edgespec.kernels.quant.quant_ref``), on CPU: nibble order, the
e2m1 table, block indexing, round trips through the quantizers, and the tiled reference product against a dense
product of the dequantized matrix. These are the oracle the GPU kernels are tested against."""

from __future__ import annotations

import pytest
import torch

from edgespec.kernels.quant.quant_ref import (
    E2M1_VALUES,
    dequant_fp8_block,
    dequant_int4,
    dequant_nvfp4,
    dequantize_rows,
    e2m1_decode,
    matmul_ref,
    pack,
    pack_nibbles,
    unpack_nibbles,
)


def test_nibble_order_low_first() -> None:
    packed = torch.tensor([[0x21, 0x43]], dtype=torch.uint8)
    assert unpack_nibbles(packed).tolist() == [[1, 2, 3, 4]]
    codes = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_e2m1_decode_matches_table() -> None:
    assert e2m1_decode(torch.arange(16)).tolist() == list(E2M1_VALUES)


def test_int4_dequant_by_hand() -> None:
    # row 0: group 0 codes 3,5 with zero 4 and scale 0.5 -> -0.5, 0.5
    q = pack_nibbles(torch.tensor([[3, 5]]))
    w = dequant_int4(q, torch.tensor([[0.5]], dtype=torch.float16), torch.tensor([[4]], dtype=torch.uint8), 2,
                     torch.float32)
    assert w.tolist() == [[-0.5, 0.5]]


def test_nvfp4_dequant_by_hand() -> None:
    codes = torch.tensor([[7, 9] + [0] * 14])          # 6.0 and -0.5, then zeros
    w = dequant_nvfp4(pack_nibbles(codes), torch.tensor([[2.0]]).to(torch.float8_e4m3fn), torch.tensor(0.25),
                      torch.float32)
    assert w[0, :2].tolist() == [3.0, -0.25] and not w[0, 2:].any()


def test_fp8_block_indexing() -> None:
    """Row 130 / column 129 fall in block (1, 1): a slice starting at row 128 must use the second block row."""
    w = torch.ones(200, 300).to(torch.float8_e4m3fn)
    s = torch.arange(1, 7, dtype=torch.float32).reshape(2, 3)
    full = dequant_fp8_block(w, s, 0, torch.float32)
    assert full[0, 0] == 1 and full[130, 129] == 5 and full[199, 299] == 6
    part = dequant_fp8_block(w[128:200], s, 128, torch.float32)
    assert torch.equal(part, full[128:200])


@pytest.mark.parametrize("fmt,tol", [("int4", 0.15), ("nvfp4", 0.15), ("fp8_block", 0.04)])
def test_quantize_round_trip(fmt: str, tol: float) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    p = pack(fmt, w)
    back = p.dequantize_rows(0, 96, torch.float32)
    err = ((back - w).norm() / w.norm()).item()
    assert 0 < err < tol, err


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8_block"])
def test_matmul_ref_tiles_equal_dense(fmt: str) -> None:
    """The tiled reference product equals x @ dequantize().T whatever the tile, with bias, for odd shapes."""
    torch.manual_seed(1)
    n, k = 300, 384
    p = pack(fmt, torch.randn(n, k) * 0.05)
    x = torch.randn(3, 5, k)
    b = torch.randn(n)
    dense = x @ dequantize_rows(p, 0, n, torch.float32).t() + b
    for tile in (64, 129, 4096):
        assert torch.allclose(matmul_ref(p, x, b, tile_rows=tile), dense, atol=1e-4, rtol=1e-4)


def test_pack_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="group size"):
        pack("int4", torch.randn(8, 100))
    with pytest.raises(ValueError, match="multiple of 16"):
        pack("nvfp4", torch.randn(8, 40))
    with pytest.raises(ValueError, match="unknown packed format"):
        pack("int3", torch.randn(8, 128))
