"""``--sm-limit``: the green-context SM limit (``edgespec.bench.sm_limit``). CPU: bad counts are refused by name,
a machine without CUDA is told so, and ``sm_count`` answers the limit while one is set. GPU (in a child process,
since a green context stays current for the rest of its process): the granted SM count read back from ``%smid``
is at least what was asked and below the whole chip, the launch heuristics see it, and a packed product run on it
still matches the torch reference."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from edgespec.bench import sm_limit
from edgespec.errors import ConfigError
from edgespec.kernels import set_sm_count_limit, sm_count


@pytest.mark.parametrize("bad", [0, -4, 2.5, "16", True])
def test_bad_counts_are_refused_by_name(bad) -> None:
    with pytest.raises(ValueError, match="SM count must be a positive integer"):
        sm_limit.limit_sms(bad)


def test_no_cuda_is_named(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        sm_limit.limit_sms(16)
    assert sm_limit.active_limit() is None


def test_bench_cli_turns_a_refusal_into_a_config_error(monkeypatch) -> None:
    from edgespec.bench.cli import run_bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--sm-limit needs a CUDA device"):
        run_bench(SimpleNamespace(sm_limit=20))


def test_sm_count_answers_the_limit() -> None:
    cuda = torch.device("cuda", 0)
    try:
        set_sm_count_limit(24)
        assert sm_count(cuda) == 24
        assert sm_count(torch.device("cpu")) == 132      # the nominal CPU figure is untouched
    finally:
        set_sm_count_limit(None)
    with pytest.raises(ValueError, match="must be positive"):
        set_sm_count_limit(0)


_CHILD = textwrap.dedent("""
    import json, torch
    from edgespec.bench.sm_limit import limit_sms
    from edgespec.kernels import sm_count
    from edgespec.kernels.quant.quant_ref import pack
    from edgespec.kernels.quant.triton_quant_gemv import quant_matmul
    lim = limit_sms(16)
    p = pack("int4", torch.randn(512, 1024, device="cuda") * 0.05)
    x = torch.randn(40, 1024, device="cuda", dtype=torch.bfloat16)
    out, ref = quant_matmul(p, x).double(), p.matmul_ref(x).double()
    print(json.dumps({"granted": lim.granted, "full": lim.device_sms, "sm_count": sm_count(torch.device("cuda")),
                      "err": ((out - ref).norm() / ref.norm()).item()}))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("triton")),
                    reason="needs a CUDA device and Triton")
def test_green_context_grants_and_confines() -> None:
    import json
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert 16 <= r["granted"] < r["full"], r
    assert r["sm_count"] == r["granted"]
    assert r["err"] < 1e-2


def test_cycle_bench_refuses_a_bad_limit_by_name(monkeypatch, capsys) -> None:
    from _tools import load_tool
    cycle_bench = load_tool("cycle_bench")
    monkeypatch.setattr(sys, "argv", ["cycle_bench", "--sm-limit", "-2"])
    with pytest.raises(SystemExit) as e:
        cycle_bench.main()
    assert e.value.code == 2
    assert "--sm-limit: the SM count must be a positive integer, got -2" in capsys.readouterr().err
