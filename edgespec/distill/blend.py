"""Blend two drafters of one shape by averaging their weights: keep what a fine-tune learnt and what it forgot.

A drafter fine-tuned for generality (self-instructed and robot requests, docs/drafters.md) accepts more on
requests worded unlike its training prompts and less on the templates its starting point had learnt. Weight-space
averaging of a fine-tune with its starting point (WiSE-FT, Wortsman et al., arXiv 2109.01903) often keeps most of
both: ``(1 - alpha) * a + alpha * b`` for every tensor. Both drafters must have the same ``config.json`` (shape,
taps, mask id), which a fine-tune with ``--init`` guarantees. The result is a drafter folder in the published
layout (bf16), its ``distill.json`` naming the two parents and ``alpha``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from edgespec.errors import CheckpointError, ConfigError


def _read(folder: Path) -> tuple[dict, dict]:
    cfg, weights = folder / "config.json", folder / "model.safetensors"
    if not cfg.is_file() or not weights.is_file():
        raise CheckpointError(f"drafter folder {folder} needs config.json and model.safetensors")
    return json.loads(cfg.read_text()), load_file(str(weights))


def blend(a: str | Path, b: str | Path, alpha: float, out: str | Path) -> Path:
    """Write ``(1 - alpha) * a + alpha * b`` (every tensor, computed in fp32, stored bf16) to ``out``."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"blend alpha {alpha} must be within 0..1 (0 = the first drafter, 1 = the second)")
    a, b, out = Path(a), Path(b), Path(out)
    cfg_a, wa = _read(a)
    cfg_b, wb = _read(b)
    if cfg_a != cfg_b:
        diff = sorted(k for k in set(cfg_a) | set(cfg_b) if cfg_a.get(k) != cfg_b.get(k))
        raise ConfigError(f"drafters {a} and {b} differ in config.json ({', '.join(diff)}): only one shape blends")
    bad = sorted(set(wa) ^ set(wb)) + sorted(k for k in set(wa) & set(wb) if wa[k].shape != wb[k].shape)
    if bad:
        raise ConfigError(f"drafters {a} and {b} hold different tensors: {', '.join(bad[:4])}")
    mixed = {k: ((1.0 - alpha) * wa[k].float() + alpha * wb[k].float()).bfloat16().contiguous() for k in wa}
    out.mkdir(parents=True, exist_ok=True)
    save_file(mixed, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(a / "config.json", out / "config.json")
    (out / "distill.json").write_text(json.dumps({"blend": {"a": str(a), "b": str(b), "alpha": alpha}}, indent=2))
    return out
