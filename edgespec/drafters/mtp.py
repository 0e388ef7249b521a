"""Native multi-token-prediction (MTP) drafter of Qwen3.5 / Qwen3.6 targets (``mtp.*`` weights).

One MTP step at position ``i`` reads the target's final post-norm hidden state ``h_i`` and the embedding of the
token at ``i+1``, and predicts the token at ``i+2``::

    u = fc(cat(norm_e(embed(x_{i+1})), norm_h(h_i)))      # embedding first
    u = mtp layer(s)(u, position i)                         # full attention with its own KV cache
    m_i = norm(u);  logits = target lm_head(m_i)

Positions are the target's: MTP row ``i`` pairs target row ``i`` with the next token and uses RoPE position ``i``
(the vLLM/SGLang convention), so the MTP KV cache has one row per committed target position and rolls back
with the target simply by keeping its committed length.

Per cycle: the committed rows of the last target forward (prefill: every prompt row; verify: rows
``0 .. accepted``; plain decode: one row) are queued with the token that follows each of them. ``propose``
first runs these queued rows in one pass (a "catch-up", writing their KV at the committed positions); its last
row is ``(h_{N-1}, x_N)`` with ``x_N`` the pending token, so its logits give draft 1. Drafts 2..k chain on the
MTP's own output: ``(m, previous draft)`` at positions ``N, N+1, ...``. Those chained KV rows are speculative:
the committed length is not advanced past them, and the next catch-up overwrites them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgespec.cache.kv import KVCache
from edgespec.drafters.base import Draft, Proposer
from edgespec.drafters.tree import DraftTree, tree_from_logits
from edgespec.errors import ConfigError
from edgespec.models.decoder import ForwardOutput, MTPHead, TargetModel


class MTPProposer(Proposer):
    """Chains ``k`` MTP steps per cycle over the target's ``mtp`` head; see the module docstring for alignment."""

    name = "mtp"
    default_k = 3

    def __init__(self, target: TargetModel, *, max_len: int = 4096) -> None:
        head = target.mtp
        if head is None or len(head.layers) == 0:
            raise ConfigError(_no_mtp_message(target))
        self.target = target
        self.head: MTPHead = head
        cfg = target.config
        self._kv_shape = (cfg.num_key_value_heads, cfg.head_dim)
        self.caches = [KVCache(max_len, *self._kv_shape, target.dtype, target.device) for _ in head.layers]
        self.length = 0                              # committed MTP rows (positions 0 .. length-1)
        self._pending_hidden: list[torch.Tensor] = []  # target hidden rows not yet run through the MTP ...
        self._pending_tokens: list[int] = []           # ... and the token following each of them
        self.last_logits: torch.Tensor | None = None   # [k, V] logits of the last propose (tests, telemetry)

    @classmethod
    def from_target(cls, model: TargetModel, *, max_seq_len: int) -> MTPProposer:
        """The MTP proposer of ``model`` for requests of up to ``max_seq_len`` tokens; ConfigError when the
        checkpoint has no ``mtp.*`` weights."""
        if model.mtp is None:
            raise ConfigError(_no_mtp_message(model))
        return cls(model, max_len=max_seq_len + cls.max_k + 1)

    # -- protocol -----------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.length = 0
        self._pending_hidden = []
        self._pending_tokens = []
        self.last_logits = None

    def begin(self, prompt_ids: Sequence[int], prefill: ForwardOutput) -> None:
        self.reset()
        # Prompt row i pairs with prompt token i+1; the last row waits for the first emitted token (commit).
        self._pending_hidden.append(prefill.hidden)
        self._pending_tokens.extend(int(t) for t in list(prompt_ids)[1:])

    def commit(self, tokens: Sequence[int], accepted: int, verify: ForwardOutput | None,
               drafted: int = 0) -> None:
        if verify is not None:
            # Rows 0 .. accepted are now in the target cache; row j is followed by tokens[j].
            rows = accepted + 1
            if verify.hidden.shape[0] < rows:
                raise RuntimeError(f"mtp needs {rows} hidden row(s) from the verify forward, got "
                                   f"{verify.hidden.shape[0]}")
            # Copied: a CUDA-graph forward returns views of its static output buffers, which the next replay
            # overwrites, and these rows wait for the next propose.
            self._pending_hidden.append(verify.hidden[:rows].clone())
        self._pending_tokens.extend(int(t) for t in tokens)

    @torch.inference_mode()
    def propose(self, last_token: int, k: int) -> Draft | None:
        hidden = torch.cat(self._pending_hidden) if len(self._pending_hidden) > 1 else self._pending_hidden[0]
        r = hidden.shape[0]
        if r == 0 or r != len(self._pending_tokens) or self._pending_tokens[-1] != last_token:
            raise RuntimeError("mtp proposer out of step with the session: every emitted token must be committed "
                               "once, in order, before the next propose")
        k = min(k, self.max_k)
        self._ensure_capacity(self.length + r + k)
        tokens = torch.tensor(self._pending_tokens, dtype=torch.long, device=hidden.device)
        # Catch-up: the committed rows, written at their committed positions.
        m = self.step(tokens, hidden, self.length)
        self.length += r
        self._pending_hidden, self._pending_tokens = [], []
        m = m[-1:]
        logits = [self.target.logits(m)[0]]
        draft = logits[0].argmax(-1, keepdim=True)
        drafts = [draft]
        # Chain: speculative rows at positions length, length+1, ... (never counted as committed).
        for j in range(1, k):
            m = self.step(draft, m, self.length + j - 1)
            logits.append(self.target.logits(m)[0])
            draft = logits[-1].argmax(-1, keepdim=True)
            drafts.append(draft)
        self.last_logits = torch.stack(logits)
        return Draft(torch.cat(drafts))

    def propose_tree(self, last_token: int, k: int, budget: int, chain_first: bool = False) -> DraftTree | None:
        """The chain :meth:`propose` drafts, with each depth's next-best tokens as leaves beside it (best-first by
        joint probability): MTP's row ``d`` follows the first-choice tokens only, so its alternatives are right
        there and nowhere else."""
        self.propose(last_token, k)
        return tree_from_logits(self.last_logits, budget, spine_only=True, chain_first=chain_first)

    # -- one MTP pass -------------------------------------------------------------------------------------------
    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Run rows ``(tokens [T], hidden [T, H])`` at positions ``start ..``; returns the normed outputs ``m``."""
        head = self.head
        e = head.pre_fc_norm_embedding(self.target.embed(tokens))
        u = head.fc(torch.cat([e, head.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        delta = None
        for layer, cache in zip(head.layers, self.caches, strict=True):
            u, delta = layer(u, delta, cache, start, self.target.rope, False, False)
        return head.norm.add_forward(delta, u)[1]

    def _ensure_capacity(self, rows: int) -> None:
        """Grow the MTP caches when a session runs longer than the settings promised (rare; copies once)."""
        cap = self.caches[0].max_len
        if rows <= cap:
            return
        new_len = max(rows, 2 * cap)
        for i, old in enumerate(self.caches):
            new = KVCache(new_len, *self._kv_shape, old.dtype, old.k.device)
            new.k[:cap] = old.k
            new.v[:old.v.shape[0]] = old.v       # key-major rows, or whole blocks of a blocked V
            self.caches[i] = new


def _no_mtp_message(model: TargetModel) -> str:
    cfg = model.config
    if cfg.family != "qwen3_5":
        return (f"drafter mtp needs a Qwen3.5/3.6 target with a native MTP head; this target is "
                f"{cfg.model_type!r}. Use --drafter dflash or ngram instead")
    return ("drafter mtp: the target checkpoint has no mtp.* weights (mtp_num_hidden_layers "
            f"{cfg.mtp_num_hidden_layers}); some conversions drop them. Use a checkpoint that keeps mtp.* "
            "or --drafter dflash / ngram")


__all__ = ["MTPProposer"]
