"""The sparse mixture-of-experts MLP of Qwen3.5/3.6 MoE (``qwen3_5_moe``, e.g. 35B-A3B), and its routing log.

Per layer: a router ``gate`` [experts, hidden] (softmax over all experts, top-k, renormalised over the k chosen),
``experts.{e}`` SwiGLU MLPs of width ``moe_intermediate_size``, and a ``shared_expert`` SwiGLU MLP whose output is
scaled by ``sigmoid(shared_expert_gate(x))`` and added to the routed sum. Parameter names are the checkpoint keys
(per-expert layout; fused ``experts.gate_up_proj``/``experts.down_proj`` files are split into them at load, see
``edgespec.loading.experts``). Each expert is the dense :class:`~edgespec.models.layers.MLP`, so every weight format
(bf16, block-FP8, NVFP4, AWQ/GPTQ int4) and the gate/up merge work unchanged; the router and the shared gate stay
in float (:class:`RouterLinear`): tiny, and expert choice is sensitive to their rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from edgespec.kernels.moe.moe import group_by_expert, grouped_expert_product, route, stacked_expert_product
from edgespec.kernels.moe.moe_packed import stacked_packed_expert_product, stacked_packed_moe
from edgespec.kernels.moe.moe_quant import stacked_int4_expert_product, stacked_int4_moe
from edgespec.kernels.moe.stacks import KERNEL_GROUPS, StackedInt4, StackedPacked
from edgespec.kernels.quant.linear import linear
from edgespec.models.config import ModelConfig
from edgespec.models.expert_stacks import stack_packed_experts
from edgespec.models.layers import MLP
from edgespec.weights.base import is_packed
from edgespec.weights.int4 import Int4Weight


class RouterLinear(nn.Module):
    """``y = x W^T`` kept in the checkpoint's float dtype: never packed by the loader nor by ``edgespec quantize``
    (both quantize :class:`~edgespec.models.layers.Linear` s only)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class RoutingLog:
    """Expert unions the MoE layers touched, summed per forward row count (1 to :data:`MAX_ROWS`) on the device.

    The union of a forward is what it reads of the experts: a plain decode step reads k experts per layer, a
    T-row verify reads between k and min(T*k, experts). The sums and call counts are device tensors updated in
    place, so recording costs no host round trip and a captured CUDA graph keeps adding to them at every replay;
    they are read only when :meth:`mean_union` or :meth:`summary` is asked (the telemetry, once per request).
    Forwards of more rows (prefill) are not recorded.
    """

    MAX_ROWS = 64

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.sums = torch.zeros(self.MAX_ROWS + 1, dtype=torch.float32, device=device)
        self.calls = torch.zeros(self.MAX_ROWS + 1, dtype=torch.float32, device=device)

    def record(self, rows: int, union: int | torch.Tensor) -> None:
        """Add one layer call of ``rows`` rows that touched ``union`` distinct experts (an int or a 0-d tensor)."""
        if rows <= self.MAX_ROWS:
            self.sums[rows] += union
            self.calls[rows] += 1

    def layer_calls(self, rows: int) -> int:
        return int(self.calls[rows]) if rows <= self.MAX_ROWS else 0

    def mean_union(self, rows: int) -> float:
        """Mean distinct experts per layer of the forwards of ``rows`` rows (0.0 when none was seen)."""
        n = self.layer_calls(rows)
        return float(self.sums[rows]) / n if n else 0.0

    def summary(self) -> dict[int, float]:
        """``{rows: mean union per layer}`` over every row count seen (one device-to-host copy)."""
        sums, calls = self.sums.tolist(), self.calls.tolist()
        return {r: sums[r] / c for r, c in enumerate(calls) if c}

    def clear(self) -> None:
        self.sums.zero_()       # in place: a captured graph keeps the same buffers
        self.calls.zero_()


class SparseMoE(nn.Module):
    """Routed experts plus the gated shared expert; ``forward`` groups rows by expert (one read per touched expert)."""

    # Set by :func:`attach_routing_log`; None: nothing recorded (no cost).
    routing_log: RoutingLog | None = None
    # The experts stacked per layer (dense weights, after loading): plain tensors whose views are the experts'
    # parameters, so the memory is counted once, as the parameters.
    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    # int4 experts stacked per layer (the shared expert as the last one where it fits): views of the same kind
    q4: StackedInt4 | None = None
    # NVFP4 or block-FP8 experts stacked per layer (edgespec.models.expert_stacks): views of the same kind
    qp: StackedPacked | None = None
    # With the shared expert stacked (int4, NVFP4 or block-FP8): the router's rows and the shared gate's row as one
    # [E + 1, H] matrix (the two RouterLinear weights are views of it), so one GEMM gives the fused routing launch
    # all its logits.
    router_w: torch.Tensor | None = None
    # False: the stacked paths route with torch ops and group in their own launch (the unfused path;
    # `tools/moe_int4_bench.py model --before` and its layer block profile compare the two).
    fused_routing: bool = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.normalise = cfg.norm_topk_prob
        self.gate = RouterLinear(H, cfg.num_experts)
        self.experts = nn.ModuleList([MLP(H, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)])
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = RouterLinear(H, 1)

    @property
    def device_routed(self) -> bool:
        """True when the experts are stacked (dense, int4, NVFP4 or block-FP8): a forward of up to 64 rows then
        keeps the expert ids on the device, so it can be captured as a CUDA graph."""
        return self.w13 is not None or self.q4 is not None or self.qp is not None

    def merge_projections(self) -> None:
        """Merge every expert's gate/up (as the dense MLP does) and the shared expert's, then stack the experts
        (:meth:`stack_experts`)."""
        self.shared_expert.merge_projections()      # first: an int4 shared expert is stacked with the experts
        for expert in self.experts:
            expert.merge_projections()
        self.stack_experts()

    def stack_experts(self) -> bool:
        """Stack dense, merged expert weights into ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` for the stacked product
        (edgespec.kernels.moe.moe); each expert's parameters become views of the stacks, so memory is unchanged but for
        one layer's copy while stacking. NVFP4 and block-FP8 experts stack into :attr:`qp`, int4 ones into :attr:`q4`
        (:meth:`_stack_int4`); other packed experts, unmerged ones and meta tensors stay as they are (False)."""
        if self.w13 is not None or self.q4 is not None or self.qp is not None:
            return True
        self.qp = stack_packed_experts(self.experts, self.shared_expert)      # merged or not; mixed formats raise
        if self.qp is not None:
            if self.qp.shared:
                self._stack_router()
            return True
        mats = [(e.gate_up_proj, e.down_proj) for e in self.experts]
        if any(up is None for up, _ in mats) or mats[0][0].weight.device.type == "meta":
            return False
        if all(isinstance(m.weight, Int4Weight) for pair in mats for m in pair):
            return self._stack_int4(mats)
        if any(is_packed(up.weight) or is_packed(down.weight) for up, down in mats):
            return False
        with torch.no_grad():
            self.w13 = torch.stack([up.weight.data for up, _ in mats])
            self.w2 = torch.stack([down.weight.data for _, down in mats])
            for i, (up, down) in enumerate(mats):
                up.weight.data = self.w13[i]
                down.weight.data = self.w2[i]
        return True

    def _stack_int4(self, mats: list[tuple[nn.Module, nn.Module]]) -> bool:
        """Stack int4 experts into :attr:`q4` (their buffers become views of it); the shared expert joins as the
        last one when it is int4 of the same width and group size. False (nothing changed) when the experts'
        group sizes differ or the kernel does not take theirs (:data:`KERNEL_GROUPS`)."""
        shared = self.shared_expert
        first = mats[0][0].weight
        if shared.gate_up_proj is not None and isinstance(shared.gate_up_proj.weight, Int4Weight) \
                and isinstance(shared.down_proj.weight, Int4Weight) \
                and shared.gate_up_proj.weight.out_features == first.out_features:
            mats = [*mats, (shared.gate_up_proj, shared.down_proj)]
            with_shared = True
        else:
            with_shared = False
        weights = [m.weight for pair in mats for m in pair]
        if first.group_size not in KERNEL_GROUPS or any(w.group_size != first.group_size for w in weights):
            return False
        stacks = {}
        with torch.no_grad():
            for part, idx in (("13", 0), ("2", 1)):
                for buf, short in (("qweight", "q"), ("scales", "s"), ("zeros", "z")):
                    stack = torch.stack([getattr(pair[idx].weight, buf) for pair in mats])
                    for i, pair in enumerate(mats):
                        setattr(pair[idx].weight, buf, stack[i])        # a view: the memory is counted once
                    stacks[short + part] = stack
        self.q4 = StackedInt4(**stacks, group_size=first.group_size, shared=with_shared)
        self.q4.check()
        if with_shared:
            self._stack_router()
        return True

    def _stack_router(self) -> None:
        """The router's rows and the shared gate's row as one matrix, :attr:`router_w` (the two weights become
        views of it: the memory is counted once), when they share a dtype and device: one GEMM then gives the
        fused routing launch all its logits."""
        router, gate = self.gate.weight, self.shared_expert_gate.weight
        if router.dtype == gate.dtype and router.device == gate.device:
            with torch.no_grad():
                self.router_w = torch.cat([router.data, gate.data])
                router.data = self.router_w[:-1]
                gate.data = self.router_w[-1:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log = self.routing_log
        if self.router_w is not None and self.fused_routing and x.is_cuda and x.shape[0] <= RoutingLog.MAX_ROWS:
            # one GEMM for the router and the shared gate, one launch to route and group, then the product
            moe = stacked_int4_moe if self.q4 is not None else stacked_packed_moe
            return moe(x, linear(x, self.router_w), self.top_k, self.normalise,
                       self.q4 if self.q4 is not None else self.qp, (log.sums, log.calls) if log is not None else None)
        weights, experts = route(self.gate(x), self.top_k, self.normalise)     # [T, k] each
        stack = self.q4 if self.q4 is not None else self.qp
        if stack is not None and x.is_cuda and x.shape[0] <= RoutingLog.MAX_ROWS:
            # one product for the touched experts and (when stacked) the shared one; the union is logged by the
            # grouping launch itself
            gate = torch.sigmoid(self.shared_expert_gate(x))
            product = stacked_int4_expert_product if self.q4 is not None else stacked_packed_expert_product
            out = product(x, weights, experts, stack, gate if stack.shared else None,
                          (log.sums, log.calls) if log is not None else None)
            return out if stack.shared else out + gate * self.shared_expert(x)
        if self.w13 is not None and x.is_cuda:
            # Expert ids stay on the device: no host round trip (the union, when logged, is read later).
            routed = stacked_expert_product(x, weights, experts, self.w13, self.w2)
            if log is not None:     # distinct experts, without bincount's host sync (it sizes its output)
                seen = torch.zeros(len(self.experts), dtype=torch.float32, device=x.device)
                log.record(x.shape[0], seen.index_fill_(0, experts.reshape(-1), 1.0).sum())
        else:
            groups = group_by_expert(experts)
            if log is not None:
                log.record(x.shape[0], groups.union)
            routed = grouped_expert_product(x, weights, experts, self.experts, groups)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


def feed_forward(cfg: ModelConfig) -> nn.Module:
    """The MLP of one decoder layer: :class:`SparseMoE` for MoE configs, else the dense SwiGLU MLP."""
    if cfg.is_moe:
        return SparseMoE(cfg)
    return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


def moe_blocks(model: nn.Module) -> list[SparseMoE]:
    """Every :class:`SparseMoE` of ``model`` (its MTP head's included); empty for a dense model."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def attach_routing_log(model: nn.Module, log: RoutingLog | None = None) -> RoutingLog | None:
    """Record every MoE layer's expert union into ``log`` (when None: the one attached already, else a new one);
    None for a dense model. Attach to the target only (its MTP head's layers are counted with the drafter), and
    before any CUDA graph is captured (the graph records into the log's buffers)."""
    blocks = [m for name, m in model.named_modules() if isinstance(m, SparseMoE) and not name.startswith("mtp.")]
    if not blocks:
        return None
    # Sessions sharing one model share its log (each request clears it first).
    device = blocks[0].gate.weight.device
    log = log if log is not None else (blocks[0].routing_log or RoutingLog(device))
    for block in blocks:
        block.routing_log = log
    return log
