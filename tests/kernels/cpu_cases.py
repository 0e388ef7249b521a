"""Inputs for the compiled CPU kernels, run both in-process (ctypes, each x86 ISA) and through the test harness
(``tests/kernels/gguf_harness.c``: natively, and cross-compiled for AArch64 under qemu-user), and the harness's
build. Each :class:`Case` names one harness command; :func:`run_native` computes its output bytes through the
library in this process, so the two can be compared bit for bit."""

from __future__ import annotations

import ctypes
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgespec.kernels.cpu import gguf_native

HARNESS = Path(__file__).with_name("gguf_harness.c")
KINDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}


@dataclass
class Case:
    """One harness command: its arguments after the file names, and the input file's bytes."""

    name: str
    args: list[str]
    data: bytes


def weight_bytes(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random ``[rows, cols]`` weights stored as ``kind`` (uint8 rows)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from edgespec.weights.gguf_kquants import random_kquant

    dense = (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)
    if kind == "F32":
        return dense.view(np.uint8)
    if kind == "F16":
        return dense.astype(np.float16).view(np.uint8)
    if kind == "BF16":
        return torch.from_numpy(dense).bfloat16().view(torch.uint8).numpy()
    if kind.endswith("_K"):
        return random_kquant(rows, cols, kind, rng, scale=0.5)
    return quants.quantize(dense, getattr(Q, kind))


def cases(seed: int = 0) -> list[Case]:
    """Products of every format at row counts 1 .. 11, embedding rows, norms and SwiGLU with row tails, attention
    with and without q/k norms, prefix and partial RoPE."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in KINDS:
        cols = 512 if kind.endswith("_K") else 96
        w = weight_bytes(kind, 37, cols, rng)
        for m in (1, 3, 8, 11):
            x = rng.standard_normal((m, cols)).astype(np.float32)
            args = [str(KINDS[kind]), "37", str(cols), str(m)]
            out.append(Case(f"matmul-{kind}-{m}", args, w.tobytes() + x.tobytes()))
        idx = np.array([0, 36, 5, 5], dtype=np.int64)
        out.append(Case(f"rows-{kind}", [str(KINDS[kind]), "37", str(cols), "4"], w.tobytes() + idx.tobytes()))
    for T, D in ((3, 72), (1, 576)):
        data = np.concatenate([rng.standard_normal(2 * T * D), rng.standard_normal(D)]).astype(np.float32)
        out.append(Case(f"norm-{T}x{D}", [str(T), str(D), "1e-05"], data.tobytes()))
    for T, inter in ((2, 40), (1, 1536)):
        g = (rng.standard_normal((T, 2 * inter)) * 6).astype(np.float32)
        out.append(Case(f"silu-{T}x{inter}", [str(T), str(inter)], g.tobytes()))
    attn = ((5, 0, 32, 0, 1, 0), (5, 37, 32, 1, 1, 0), (1, 200, 16, 0, 1, 0), (8, 3, 32, 1, 1, 0),
            (6, 40, 32, 1, 0, 1), (4, 20, 32, 0, 1, 1))      # the last two: a DFlash block (all rows, masks)
    for T, start, rd, norms, causal, masked in attn:
        H, Hkv, hd, length = 6, 2, 32, 256
        qkv = rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(np.float32)
        angles = rng.standard_normal((T, rd // 2)).astype(np.float32)
        cos, sin = np.cos(np.concatenate([angles, angles], 1)), np.sin(np.concatenate([angles, angles], 1))
        parts = [qkv, cos.astype(np.float32), sin.astype(np.float32)]
        if norms:
            parts += [rng.standard_normal(hd).astype(np.float32) for _ in range(2)]
        if masked:
            parts.append(np.where(rng.random((T, start + T)) < 0.3, -np.inf, 0.0).astype(np.float32))
            parts[-1][:, start:] = 0.0                      # a row always sees the block's own keys
        cache = np.zeros((2, length, Hkv, hd), dtype=np.float32)
        cache[:, :start] = rng.standard_normal((2, start, Hkv, hd))
        data = b"".join(p.tobytes() for p in parts) + cache.tobytes()
        args = [str(v) for v in (T, H, Hkv, hd, rd, start, length, repr(float(np.float32(hd ** -0.5))), "1e-06",
                                 norms, causal, masked)]
        out.append(Case(f"attn-{T}-{start}-{rd}-{norms}-{causal}-{masked}", args, data))
    return out


def _f32(buf: bytes, offset: int, count: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(buf[offset:offset + 4 * count]), dtype=torch.float32)


def run_native(case: Case) -> bytes:
    """The case's output through the library loaded in this process (the ISA currently chosen)."""
    lib, data, cmd = gguf_native.library(), case.data, case.name.split("-")[0]
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if cmd in ("matmul", "rows"):
        kind, N, K, M = (int(a) for a in case.args)
        nbytes = len(data) - (4 * M * K if cmd == "matmul" else 8 * M)   # the weight's bytes come first
        out = torch.empty(M, N if cmd == "matmul" else K)
        ptr = buf.data_ptr()
        rc = (lib.gguf_matmul(kind, ptr, N, K, ptr + nbytes, M, out.data_ptr(), 2) if cmd == "matmul"
              else lib.gguf_rows(kind, ptr, N, K, ptr + nbytes, M, out.data_ptr()))
        assert rc == 0, case.name
        return out.numpy().tobytes()
    if cmd == "norm":
        T, D = int(case.args[0]), int(case.args[1])
        x, r, w = _f32(data, 0, T * D), _f32(data, 4 * T * D, T * D), _f32(data, 8 * T * D, D)
        s, y = torch.empty(T * D), torch.empty(T * D)
        lib.add_rms_norm_f32(x.data_ptr(), r.data_ptr(), w.data_ptr(), ctypes.c_float(float(case.args[2])), T, D,
                             s.data_ptr(), y.data_ptr())
        return s.numpy().tobytes() + y.numpy().tobytes()
    if cmd == "silu":
        T, inter = int(case.args[0]), int(case.args[1])
        g, o = _f32(data, 0, 2 * T * inter), torch.empty(T * inter)
        lib.silu_mul_f32(g.data_ptr(), T, inter, o.data_ptr())
        return o.numpy().tobytes()
    T, H, Hkv, hd, rd, start, length = (int(a) for a in case.args[:7])
    scale, eps, norms, causal, masked = float(case.args[7]), float(case.args[8]), *(int(a) for a in case.args[9:])
    floats = _f32(data, 0, len(data) // 4)
    at = 0

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return floats[at - n:at]

    qkv, cos, sin = take(T * (H + 2 * Hkv) * hd), take(T * rd), take(T * rd)
    qn, kn = (take(hd), take(hd)) if norms else (None, None)
    bias = take(T * (start + T)) if masked else None
    kc, vc = take(length * Hkv * hd).clone(), take(length * Hkv * hd).clone()
    o = torch.empty(T * H * hd)
    rc = lib.block_attention_f32(qkv.data_ptr(), T, H, Hkv, hd, cos.data_ptr(), sin.data_ptr(), rd,
                                 None if qn is None else qn.data_ptr(), None if kn is None else kn.data_ptr(), eps,
                                 kc.data_ptr(), vc.data_ptr(), start, causal, None if bias is None else bias.data_ptr(),
                                 scale, o.data_ptr(), 2)
    assert rc == 0, case.name
    return o.numpy().tobytes() + kc.numpy().tobytes() + vc.numpy().tobytes()


def build_harness(cc: str, out: Path, static: bool) -> Path | None:
    """The harness linked with the library's objects for ``cc``'s architecture; None when ``cc`` is missing or
    the build fails (the error is printed)."""
    tool = gguf_native.Toolchain.find(cc)
    if tool is None:
        return None
    work = out.parent / f"objects-{tool.arch}"
    work.mkdir(parents=True, exist_ok=True)
    objects, err = gguf_native.compile_objects(tool, work)
    if err:
        print(err)
        return None
    cmd = [tool.cc, "-O2", "-std=gnu11", "-ffp-contract=off", "-pthread", f"-I{gguf_native.HERE}", str(HARNESS),
           *map(str, objects), "-o", str(out), "-lm"] + (["-static"] if static else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-2000:])
        return None
    return out


def run_harness(prefix: list[str], binary: Path, case: Case, work: Path, isa: str | None = None) -> bytes:
    """The case's output through the harness (``prefix``: e.g. ``["qemu-aarch64"]``)."""
    src, dst = work / f"{case.name}.in", work / f"{case.name}.out"
    src.write_bytes(case.data)
    cmd = [*prefix, str(binary), case.name.split("-")[0], str(src), str(dst), *case.args] + ([isa] if isa else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{case.name}: {proc.stderr}"
    return dst.read_bytes()


def _weight_record(kind: int, N: int, K: int, data_ptr: int, bias_ptr: int | None) -> bytes:
    """One gguf_weight_t as the dump holds it: kind, N, K, has-bias, the bias, the rows' bytes."""
    size = N * K * {0: 4, 1: 2, 30: 2}[kind] if kind in (0, 1, 30) else None
    if size is None:
        from gguf import GGML_QUANT_SIZES
        from gguf import GGMLQuantizationType as Q
        block, nbytes = GGML_QUANT_SIZES[Q(kind)]
        size = N * (K // block) * nbytes
    head = np.array([kind, N, K, int(bias_ptr is not None)], dtype=np.int32).tobytes()
    bias = ctypes.string_at(bias_ptr, 4 * N) if bias_ptr is not None else b""
    return head + bias + ctypes.string_at(data_ptr, size)


def _table_record(weight: torch.Tensor) -> bytes:
    """An embedding table or head: GGUF blocks as they are, a dense one as fp32 rows."""
    from edgespec.weights.base import is_packed
    if is_packed(weight):
        return _weight_record(weight.ggml_type, weight.out_features, weight.in_features, weight.blocks.data_ptr(),
                              None)
    w = weight.detach().float().contiguous()
    return _weight_record(0, w.shape[0], w.shape[1], w.data_ptr(), None)


def write_stack_dump(model, prompt: list[int], max_len: int, path: Path) -> Path:
    """The stack description the C forward receives (``edgespec.models.cpu_stack``), the embedding, head, rotary
    tables and a prompt, in the layout ``gguf_harness.c greedy`` reads."""
    from edgespec.models.cpu_stack import plan_of

    plan = plan_of(model)
    assert plan is not None, "the model does not run on the C stack"
    s = plan.stack
    ints = [s.n_layers, s.D, s.H, s.Hkv, s.hd, s.I, s.rd, model.config.vocab_size, max_len, len(prompt)]
    parts = [b"ESGS", np.array(ints, dtype=np.int32).tobytes(), np.array([s.eps, s.scale], dtype=np.float32).tobytes()]
    parts += [model.rope.cos[:max_len].contiguous().numpy().tobytes(),
              model.rope.sin[:max_len].contiguous().numpy().tobytes(),
              ctypes.string_at(s.final_norm, 4 * s.D)]
    parts += [_table_record(model.model.embed_tokens.weight), _table_record(model.lm_head_weight)]
    for layer in plan.layers:
        parts += [ctypes.string_at(layer.in_norm, 4 * s.D), ctypes.string_at(layer.post_norm, 4 * s.D)]
        has_qk = layer.q_norm is not None
        parts.append(np.array([int(has_qk)], dtype=np.int32).tobytes())
        if has_qk:
            parts += [ctypes.string_at(layer.q_norm, 4 * s.hd), ctypes.string_at(layer.k_norm, 4 * s.hd)]
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            parts.append(_weight_record(w.kind, w.N, w.K, w.data, w.bias))
    parts.append(np.array(prompt, dtype=np.int32).tobytes())
    path.write_bytes(b"".join(parts))
    return path


def python_greedy(model, prompt: list[int], n_new: int, max_len: int) -> list[int]:
    """Greedy tokens of ``model`` after ``prompt`` through ``TargetModel.forward`` (prefill, then one row a step)."""
    cache = model.new_cache(max_len)
    logits = model.forward(torch.tensor(prompt), cache, logits="last").logits[-1]
    out = []
    for _ in range(n_new):
        out.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(out[-1:]), cache).logits[-1]
    return out
