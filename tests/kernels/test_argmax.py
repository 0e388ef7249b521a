"""The greedy verdict (:mod:`edgespec.kernels.verify.argmax`): the reference against a plain-Python definition, the
dispatcher's validation, and on CUDA the Triton kernels bit-exact against torch, also inside a CUDA graph."""

from __future__ import annotations

import importlib.util
import math
import zlib

import pytest
import torch
from _devices import DEVICES

from edgespec.kernels.verify.argmax import greedy_verdict, greedy_verdict_ref

_READY = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def _fresh_seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def python_verdict(logits: torch.Tensor, tokens: torch.Tensor) -> list[int]:
    """The definition in loops: first index of the maximum (NaN above everything), then the matching prefix."""
    targets = []
    for row in logits.float().tolist():
        best = 0
        for j, v in enumerate(row):
            b = row[best]
            if math.isnan(b):
                break
            if math.isnan(v) or v > b:
                best = j
        targets.append(best)
    toks = tokens.tolist()
    n = 0
    while n < len(toks) - 1 and toks[n + 1] == targets[n]:
        n += 1
    return [n, *targets]


def make_tokens(logits: torch.Tensor, agree: int) -> torch.Tensor:
    """Random tokens whose first ``agree`` drafts equal the argmax of the row before them (and the next does not,
    unless every draft agrees)."""
    R, V = logits.shape
    targets = logits.argmax(-1)
    tokens = torch.randint(0, V, (R,), device=logits.device)
    tokens[1:1 + agree] = targets[:agree]
    if agree < R - 1:
        tokens[agree + 1] = (targets[agree] + 1) % V
    return tokens


def make_logits(kind: str, R: int, V: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    if kind == "randn":
        return torch.randn(R, V, device=device).to(dtype)
    if kind == "ties":                          # three levels: every row has many equal maxima
        return torch.randint(0, 3, (R, V), device=device).to(dtype)
    if kind == "neginf":                        # masked entries, one fully masked row, a tie at the top
        x = torch.randn(R, V, device=device)
        x[:, ::3] = float("-inf")
        x[R // 2] = float("-inf")
        x[0, 1] = x[0, V - 1] = 100.0
        return x.to(dtype)
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------------ CPU

CPU_CASES = [
    # (kind, R, V, agree)
    ("randn", 1, 37, 0),
    ("randn", 5, 50, 2),
    ("randn", 9, 64, 8),     # every draft matches: n = R - 1
    ("randn", 9, 64, 0),     # first mismatch at 0
    ("ties", 1, 40, 0),
    ("ties", 8, 30, 7),
    ("ties", 17, 25, 4),
    ("neginf", 6, 45, 5),
    ("neginf", 4, 33, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,R,V,agree", CPU_CASES)
def test_reference_matches_python(kind: str, R: int, V: int, agree: int, dtype: torch.dtype) -> None:
    logits = make_logits(kind, R, V, dtype)
    tokens = make_tokens(logits, agree)
    got = greedy_verdict_ref(logits, tokens)
    assert got.dtype == torch.int64 and got.shape == (R + 1,)
    assert got.tolist() == python_verdict(logits, tokens)
    assert got[0].item() == agree


def test_reference_ties_nan_and_signed_zero() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0],
                           [-0.0, 0.0, -1.0, 0.0],
                           [float("-inf")] * 4,
                           [1.0, float("nan"), float("inf"), float("nan")]])
    tokens = torch.tensor([9, 1, 0, 0])
    assert greedy_verdict_ref(logits, tokens).tolist() == [3, 1, 0, 0, 1]
    assert greedy_verdict_ref(logits, tokens).tolist() == python_verdict(logits, tokens)


@pytest.mark.parametrize("with_out", [False, True])
def test_dispatcher_cpu(with_out: bool) -> None:
    logits = make_logits("ties", 16, 300, torch.bfloat16)
    tokens = make_tokens(logits, 6).to(torch.int32)
    ref = greedy_verdict_ref(logits, tokens)
    out = torch.full((17,), -1, dtype=torch.int64) if with_out else None
    got = greedy_verdict(logits, tokens, out)
    assert torch.equal(got, ref)
    if with_out:
        assert got is out


def test_dispatcher_row_slice_cpu() -> None:
    big = torch.randn(20, 500)
    logits = big[3:8, 100:]
    tokens = make_tokens(logits, 3)
    assert greedy_verdict(logits, tokens).tolist() == python_verdict(logits, tokens)


BAD = [
    # (logits shape, logits dtype, tokens shape, tokens dtype, out shape, out dtype, message fragment)
    ((4, 3, 2), torch.float32, (4,), torch.int64, None, None, "2-D"),
    ((10,), torch.float32, (10,), torch.int64, None, None, "2-D"),
    ((0, 10), torch.float32, (0,), torch.int64, None, None, "no rows"),
    ((4, 0), torch.float32, (4,), torch.int64, None, None, "empty vocab"),
    ((4, 10), torch.int64, (4,), torch.int64, None, None, "floating point"),
    ((4, 10), torch.float32, (5,), torch.int64, None, None, "length R"),
    ((4, 10), torch.float32, (4, 1), torch.int64, None, None, "1-D"),
    ((4, 10), torch.float32, (4,), torch.float32, None, None, "tokens must be int64"),
    ((4, 10), torch.float32, (4,), torch.int64, (4,), torch.int64, "out must have shape"),
    ((4, 10), torch.float32, (4,), torch.int64, (5, 1), torch.int64, "out must have shape"),
    ((4, 10), torch.float32, (4,), torch.int64, (5,), torch.int32, "out must be int64"),
]


@pytest.mark.parametrize("lshape,ldtype,tshape,tdtype,oshape,odtype,msg", BAD)
def test_bad_inputs(lshape, ldtype, tshape, tdtype, oshape, odtype, msg) -> None:
    logits = torch.zeros(lshape, dtype=ldtype)
    tokens = torch.zeros(tshape, dtype=tdtype)
    out = torch.zeros(oshape, dtype=odtype) if oshape is not None else None
    with pytest.raises(ValueError, match=msg):
        greedy_verdict(logits, tokens, out)


# ------------------------------------------------------------------------------------------------ GPU

DEV = "cuda"


def check_exact(logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """Triton (through the dispatcher) equals torch.argmax and the reference bit for bit; ``out`` is poisoned."""
    out = torch.full((logits.shape[0] + 1,), -7, dtype=torch.int64, device=logits.device)
    got = greedy_verdict(logits, tokens, out)
    assert got is out
    torch.testing.assert_close(got[1:], logits.argmax(-1), rtol=0, atol=0)
    torch.testing.assert_close(got, greedy_verdict_ref(logits, tokens), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("V", [1000, 151936, 248320])
@pytest.mark.parametrize("R", [1, 2, 16, 17])
@pytest.mark.parametrize("kind", ["randn", "ties", "neginf"])
@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason="needs CUDA")
def test_triton_exact(kind: str, R: int, V: int, dtype: torch.dtype) -> None:
    logits = make_logits(kind, R, V, dtype, DEV)
    for agree in sorted({0, R // 2, R - 1}):
        check_exact(logits, make_tokens(logits, agree))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason="needs CUDA")
def test_triton_strided_and_special_values(dtype: torch.dtype) -> None:
    big = torch.randint(0, 4, (40, 248320 + 64), device=DEV).to(dtype)
    rows = big[3:20, 64:]                                    # row slice: row stride != V
    check_exact(rows, make_tokens(rows, 9))
    check_exact(big[:5, ::2], make_tokens(big[:5, ::2], 2))  # column stride 2: copied to contiguous
    x = torch.zeros(6, 248320, device=DEV, dtype=dtype)
    x[0, 7] = x[0, 200000] = 5.0                             # tie across chunks: the lower index wins
    x[1] = float("-inf")
    x[2, 3], x[2, 9] = -0.0, 1.0
    x[2, 100] = 1.0
    x[3, 248319] = float("nan")
    x[4, 10], x[4, 20] = float("inf"), float("nan")
    x[5, 1] = float("nan")
    x[5, 2] = float("nan")
    check_exact(x, make_tokens(x, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason="needs CUDA")
def test_triton_many_rows() -> None:
    logits = make_logits("ties", 150, 70000, torch.bfloat16, DEV)   # stage 2 loops over row blocks
    check_exact(logits, make_tokens(logits, 120))


@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason="needs CUDA")
def test_no_host_sync() -> None:
    logits = make_logits("randn", 16, 248320, torch.bfloat16, DEV)
    tokens = make_tokens(logits, 4)
    greedy_verdict(logits, tokens)                                   # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        greedy_verdict(logits, tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("R", [1, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason="needs CUDA")
def test_cuda_graph_replay(R: int) -> None:
    V = 248320
    logits = make_logits("randn", R, V, torch.bfloat16, DEV)
    tokens = make_tokens(logits, R - 1)
    out = torch.full((R + 1,), -7, dtype=torch.int64, device=DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                                 # warm-up: Triton compiles outside capture
        greedy_verdict(logits, tokens, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy_verdict(logits, tokens, out)
    for kind, agree in (("randn", R // 2), ("ties", 0), ("neginf", R - 1)):
        logits.copy_(make_logits(kind, R, V, torch.bfloat16, DEV))
        tokens.copy_(make_tokens(logits, agree))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, greedy_verdict_ref(logits, tokens), rtol=0, atol=0)
        assert out[0].item() == agree


@pytest.mark.parametrize("device", DEVICES)
def test_row_argmax_equals_torch(device):
    """row_argmax (the DFlash draft graph's argmax) = torch.argmax, ties included, on a drafter-sized head output."""
    from edgespec.kernels.verify.argmax import row_argmax
    x = torch.randint(0, 4, (15, 248320), device=device).to(torch.bfloat16)      # heavy ties
    assert torch.equal(row_argmax(x), x.argmax(-1))
    y = torch.randn(3, 1000, device=device)
    assert torch.equal(row_argmax(y), y.argmax(-1))
