"""``edgespec doctor``: what this machine offers (versions, device, compute capability, arch, free memory)."""

from __future__ import annotations

import platform
from typing import Any

import torch

from edgespec import __version__


def report() -> dict[str, Any]:
    from edgespec.arch.detect import detect_arch

    info: dict[str, Any] = {
        "edgespec": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": torch.__version__,
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed (GPU kernels fall back to torch)"
    info["cuda (torch build)"] = torch.version.cuda or "none (CPU build)"
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        info.update({
            "device": props.name,
            "compute capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "free / total memory": f"{free / 2**30:.1f} / {total / 2**30:.1f} GiB",
            "detected arch": detect_arch(dev),
        })
    else:
        import os
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info.update({"device": "cpu", "compute capability": "n/a", "cpu threads": torch.get_num_threads(),
                     "free memory": f"{pages / 2**30:.1f} GiB", "detected arch": "base"})
    return info
