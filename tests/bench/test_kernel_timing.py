"""The kernel timing helpers the tools and lab probes share (edgespec.bench.kernel_timing): a bad flush mode is
refused by name before anything touches a GPU."""

from __future__ import annotations

import pytest

from edgespec.bench.kernel_timing import FLUSH_MODES, graph_us


def test_a_bad_flush_mode_is_named() -> None:
    assert FLUSH_MODES == ("write", "read")
    with pytest.raises(ValueError, match="flush mode 'clean'"):
        graph_us(lambda: None, flush_mode="clean")
