"""The Nemotron-H family (Nemotron-H, Nemotron-Nano-v2, Nemotron-3-Nano-4B and -30B-A3B): the
computation of transformers' ``NemotronHForCausalLM`` (5.17), with its weight names, served
from a :class:`ServingCache`.

A stack of pre-norm residual blocks, one mixer each, in the order of the layer pattern
(``hybrid_override_pattern``: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` mixture of experts):

- Mamba-2: ``in_proj`` -> (z, xBC, dt); causal depthwise conv1d + SiLU over xBC -> (x, B, C);
  SSM with A = -exp(A_log), softplus(dt + dt_bias), D skip; RMSNorm of y * silu(z) by groups
  (``n_groups`` groups, gate before norm); ``out_proj``.
- attention: q/k/v/o projections without bias, GQA, scale head_dim^-0.5, causal, and no
  positional embedding at all (no rotary: the Mamba layers carry position).
- MLP: ``down_proj(relu(up_proj(x))^2)``.
- mixture of experts (transformers' ``NemotronHMoE``): a router picks ``num_experts_per_tok``
  of ``n_routed_experts`` experts per token: fp32 logits, sigmoid scores; the choice adds
  ``e_score_correction_bias`` to the scores and keeps the ``topk_group`` of ``n_group`` expert
  groups whose two best (biased) scores sum highest; the weights are the chosen experts'
  unbiased scores, normalised to sum 1 (``norm_topk_prob``), times ``routed_scaling_factor``.
  The experts are relu^2 MLPs without bias (:func:`moe.routed_experts`, summed in fp32 as
  transformers does), inside ``fc1_latent_proj``/``fc2_latent_proj`` when ``moe_latent_size``
  is set; one shared relu^2 MLP (``moe_shared_expert_intermediate_size``) of the block's input
  is added. The router has no host synchronisation, so a decode step stays capturable.
- RMSNorm (fp32 statistics) before each mixer and at the end (``norm_f``), then ``lm_head``.

Prefill runs the SSM by a chunked scan in fp32 (below), from the slot's state when it continues
one, and loads each layer's final state into the state cache; decode runs
``replayssm.mamba2_decode`` without its gate: the gated norm applies silu(z) in fp32, as
transformers' does, reading z where ``in_proj`` wrote it (handing z to the op would need a dense
copy of it per layer and step).

One difference transformers has between its own two paths is kept: its prefill clamps the
softplus'd dt at ``time_step_min`` (the mixer's ``time_step_limit``), its decode does not
(nor does our decode op). It only binds where softplus(dt + dt_bias) < time_step_min.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import replayssm

from . import fused, moe
from .base import (CacheLayout, DecodeContext, HybridModel, PrefillContext, ServingCache,
                   causal_attention, weight_constant)
from .loader import stack_tensors

__all__ = ["NemotronHConfig", "NemotronHModel", "ssd_chunk_scan"]

# Layer pattern characters, and the layer type names configs use for them (transformers 5.17's
# and the hub's older ones).
_MAMBA_LAYER, _ATTENTION_LAYER, _MLP_LAYER, _MOE_LAYER = "M", "*", "-", "E"
_TYPE_NAMES = {"mamba": _MAMBA_LAYER, "linear_attention": _MAMBA_LAYER, "attention": _ATTENTION_LAYER,
               "full_attention": _ATTENTION_LAYER, "mlp": _MLP_LAYER, "moe": _MOE_LAYER}
# Older config.json field names transformers still reads.
# Hub checkpoints (and transformers' save_pretrained) name the backbone "backbone.", the
# modules "model.".
_HUB_PREFIX = "backbone."
_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
            "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
            "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
            "mamba_chunk_size": "chunk_size", "num_local_experts": "n_routed_experts"}


@dataclasses.dataclass
class NemotronHConfig:
    """A Nemotron-H layout, with the field names of transformers' NemotronHConfig (5.17);
    ``pattern`` is its ``hybrid_override_pattern``."""

    model_type: ClassVar[str] = "nemotron_h"

    vocab_size: int
    hidden_size: int
    pattern: str
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False        # in_proj and out_proj of the Mamba mixers
    mlp_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    time_step_min: float = 0.001  # prefill's dt floor; also the dt_bias init range
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    chunk_size: int = 128
    tie_word_embeddings: bool = False
    # Mixture-of-experts layers ('E'); transformers' defaults. Unused without 'E' layers.
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None  # None: the experts work at hidden_size, no projections
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.pattern) - {_MAMBA_LAYER, _ATTENTION_LAYER, _MLP_LAYER, _MOE_LAYER})
        if unknown or not self.pattern:
            raise ValueError(f"layer pattern {self.pattern!r}: each layer is one of 'M' "
                             "(Mamba-2), '*' (attention), '-' (MLP), 'E' (mixture of experts)")
        if _MOE_LAYER in self.pattern:
            self._check_moe()
        if _MAMBA_LAYER not in self.pattern:
            raise ValueError(f"layer pattern {self.pattern!r} has no Mamba-2 layer")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of "
                             f"n_groups ({self.n_groups})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")

    def _check_moe(self) -> None:
        E, groups, kept, k = (self.n_routed_experts, self.n_group, self.topk_group,
                              self.num_experts_per_tok)
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "moe_shared_expert_intermediate_size", "n_group", "topk_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be at least 1")
        if self.moe_latent_size is not None and self.moe_latent_size < 1:
            raise ValueError(f"moe_latent_size ({self.moe_latent_size}) must be None or at least 1")
        if E % groups:
            raise ValueError(f"n_routed_experts ({E}) must be a multiple of n_group ({groups})")
        if E // groups < 2:
            # A group's score is the sum of its two best experts' scores.
            raise ValueError(f"n_routed_experts ({E}) / n_group ({groups}): each expert group "
                             "needs at least 2 experts (a group scores by its best two)")
        if kept > groups:
            raise ValueError(f"topk_group ({kept}) must be at most n_group ({groups})")
        if k > kept * (E // groups):
            raise ValueError(f"num_experts_per_tok ({k}) exceeds the experts of the topk_group "
                             f"({kept}) groups a token keeps ({kept * (E // groups)})")

    # ---- derived sizes ------------------------------------------------------------------------

    @property
    def num_hidden_layers(self) -> int:
        return len(self.pattern)

    @property
    def mamba_intermediate(self) -> int:
        """Width of x, z and y: heads * head_dim (not expand * hidden_size)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv1d: x, B and C."""
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    # ---- config.json --------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "NemotronHConfig":
        """From a config.json dict (``hybrid_override_pattern`` or ``layers_block_type``; older
        field names as transformers reads them). Refuses activations other than the family's,
        and shared-expert counts other than transformers' one.

        ``moe_shared_expert_overlap`` is read and ignored, as transformers ignores it (Megatron's
        overlap of the shared expert with the routed experts' communication: scheduling, not
        results)."""
        if d.get("model_type", cls.model_type) != cls.model_type:
            raise ValueError(f"model_type {d.get('model_type')!r} is not {cls.model_type!r}")
        if ("num_local_experts" in d and "n_routed_experts" in d
                and d["num_local_experts"] != d["n_routed_experts"]):
            raise ValueError(f"config has both num_local_experts ({d['num_local_experts']}) and "
                             f"n_routed_experts ({d['n_routed_experts']}), which differ")
        d = {_ALIASES.get(k, k): v for k, v in d.items()}
        for field, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if d.get(field, want) != want:
                raise NotImplementedError(f"{field} {d[field]!r}: this family computes {want}")
        if "layers_block_type" in d and d["layers_block_type"] is not None:
            try:
                pattern = "".join(_TYPE_NAMES[t] for t in d["layers_block_type"])
            except KeyError as e:
                raise ValueError(f"unknown layer type {e.args[0]!r} in layers_block_type") from None
        elif "hybrid_override_pattern" in d:
            pattern = d["hybrid_override_pattern"]
        else:
            raise ValueError("config has neither hybrid_override_pattern nor layers_block_type")
        if _MOE_LAYER in pattern and d.get("n_shared_experts", 1) != 1:
            # transformers builds one shared MLP whatever this says: another count is a layout
            # nobody has checked against it.
            raise NotImplementedError(f"n_shared_experts {d['n_shared_experts']!r}: this family "
                                      "computes one shared expert per MoE layer")
        names = {f.name for f in dataclasses.fields(cls)} - {"pattern"}
        return cls(pattern=pattern, **{k: v for k, v in d.items() if k in names})

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers' NemotronHConfig(**d) takes."""
        d = dataclasses.asdict(self)
        d["hybrid_override_pattern"] = d.pop("pattern")
        d.update(model_type=self.model_type, architectures=["NemotronHForCausalLM"],
                 mlp_hidden_act="relu2", mamba_hidden_act="silu",
                 num_hidden_layers=self.num_hidden_layers, n_shared_experts=1)
        return d

    # ---- presets ------------------------------------------------------------------------------

    @classmethod
    def nano4b(cls) -> "NemotronHConfig":
        """The layout of NVIDIA-Nemotron-3-Nano-4B (dense: Mamba-2, attention, MLP; no MoE).

        Numbers from the model's public config.json (nvidia/NVIDIA-Nemotron-3-Nano-4B-BF16),
        as reproduced by several public projects' tests and configs, which agree: vocab_size
        131072, hidden_size 3136, 42 layers with hybrid_override_pattern
        "M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-" (21 Mamba-2, 4 attention, 17 MLP),
        intermediate_size 12544 (relu2), mamba_num_heads 96 x mamba_head_dim 80 (d_inner 7680),
        ssm_state_size 128, n_groups 8, conv_kernel 4, chunk_size 256, use_conv_bias true,
        mamba_proj_bias false, 40 attention heads, 8 KV heads, head_dim 128, attention_bias
        false, tie_word_embeddings false. This is the Mamba-2 shape the layer benchmark calls
        nano4b (96 x 80 x 128, 8 groups).

        Assumed (not in those excerpts; transformers' defaults, which the family's other public
        configs also use): layer_norm_epsilon 1e-5, time_step_min 0.001, time_step_max 0.1,
        time_step_floor 1e-4, use_bias false (the Mamba projections), mlp_bias false. Only
        time_step_min changes results (prefill's dt floor); the rest are the values or the
        initialisation of random weights.
        """
        return cls(vocab_size=131072, hidden_size=3136,
                   pattern="M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-",
                   intermediate_size=12544, num_attention_heads=40, num_key_value_heads=8,
                   head_dim=128, mamba_num_heads=96, mamba_head_dim=80, ssm_state_size=128,
                   n_groups=8, conv_kernel=4, use_conv_bias=True, chunk_size=256)

    @classmethod
    def nano30b_a3b(cls) -> "NemotronHConfig":
        """The layout of NVIDIA-Nemotron-3-Nano-30B-A3B (Mamba-2, attention, MoE; no dense MLP).

        Numbers from the model's public config.json (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16),
        as reproduced in full or in part by several public projects' tests and configs, which
        agree: vocab_size 131072, hidden_size 2688, 52 layers with hybrid_override_pattern
        "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME" (23 Mamba-2, 23 MoE, 6 attention),
        mamba_num_heads 64 x mamba_head_dim 64 (d_inner 4096), ssm_state_size 128, n_groups 8,
        conv_kernel 4, chunk_size 128, use_conv_bias true, mamba_proj_bias false, use_bias
        false, 32 attention heads, 2 KV heads, head_dim 128, attention_bias false,
        intermediate_size 1856 (no '-' layer uses it), mlp_hidden_act relu2, mlp_bias false,
        n_routed_experts 128, num_experts_per_tok 6, moe_intermediate_size 1856,
        n_shared_experts 1, moe_shared_expert_intermediate_size 3712, n_group 1, topk_group 1,
        norm_topk_prob true, routed_scaling_factor 2.5, layer_norm_epsilon 1e-5, time_step_min
        0.001, time_step_max 0.1, time_step_floor 1e-4, tie_word_embeddings false. The config has
        no moe_latent_size (None: no latent projections). A Megatron-Bridge dump of the same
        model agrees on the MoE numbers (128 experts, top 6, sigmoid scores, scaling 2.5, shared
        width 3712, 52 layers). Some prose descriptions (the model card, Megatron-Bridge's docs)
        say 5 experts per token; every config.json copy says num_experts_per_tok 6, which is
        what transformers reads.

        Assumed: nothing beyond the config (every field above is in it); its multi-token
        prediction heads, if a checkpoint has them, are skipped as ``mtp.*`` tensors. With one
        expert group the group limit is a no-op: routing is a plain top-6 of the biased scores.
        """
        return cls(vocab_size=131072, hidden_size=2688,
                   pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                   intermediate_size=1856, num_attention_heads=32, num_key_value_heads=2,
                   head_dim=128, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128,
                   n_groups=8, conv_kernel=4, use_conv_bias=True, chunk_size=128,
                   n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                   moe_shared_expert_intermediate_size=3712, moe_latent_size=None, n_group=1,
                   topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)

    @classmethod
    def tiny(cls, **overrides: Any) -> "NemotronHConfig":
        """A test layout: every layer kind twice or more, grouped heads (4 heads per group, 2 per
        KV head), a chunk size below a test prompt's length so prefill crosses chunks."""
        fields = dict(vocab_size=128, hidden_size=64, pattern="M*-M-M*-", intermediate_size=96,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
                      chunk_size=8)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def tiny_moe(cls, **overrides: Any) -> "NemotronHConfig":
        """:meth:`tiny` with MoE layers: every layer kind, MoE twice; 8 experts in 2 groups of
        4, one group kept, top 2, and a scaling other than 1 (so that a missing factor shows)."""
        fields = dict(pattern="M*EM-ME*", n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                      n_group=2, topk_group=1, routed_scaling_factor=2.5)
        fields.update(overrides)
        return cls.tiny(**fields)


def _stack_experts(cfg: NemotronHConfig, tensors: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """``tensors`` with each MoE layer's per-expert projections (``{prefix}layers.{i}.mixer.
    experts.{e}.up_proj.weight``, e = 0..E-1) replaced by their stack under transformers'
    name (``...experts.up_proj``), in the checkpoint's own prefix. Layers stored stacked
    already, or whose experts are absent altogether, are left for ``check_tensors`` to judge;
    per-expert tensors beside a stacked one, or of experts past E, stay and are refused as
    unknown."""
    prefix = _HUB_PREFIX if any(k.startswith(_HUB_PREFIX) for k in tensors) else "model."
    width = cfg.moe_latent_size or cfg.hidden_size
    shapes = {"up_proj": (cfg.moe_intermediate_size, width),
              "down_proj": (width, cfg.moe_intermediate_size)}
    out = tensors
    for i, kind in enumerate(cfg.pattern):
        if kind != _MOE_LAYER:
            continue
        base = f"{prefix}layers.{i}.mixer.experts."
        for proj, shape in shapes.items():
            parts = [f"{base}{e}.{proj}.weight" for e in range(cfg.n_routed_experts)]
            if base + proj in tensors or not any(name in tensors for name in parts):
                continue
            if out is tensors:
                out = dict(tensors)  # the caller's dict stays as it was
            out[base + proj] = stack_tensors(tensors, parts, shape)
            for name in parts:
                del out[name]
    return out


# ---- the chunked scan ---------------------------------------------------------------------

def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, chunk_size: int, state: torch.Tensor | None = None,
                   every: int = 0, kept: list[torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's SSM over a sequence from ``state`` [H, P, N] (None: zeros), in chunks (fp32):
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t (no D term).

    x [n, H, P]; dt [n, H] (after bias, softplus and clamp); A [H]; B, C [n, G, N]. Within a
    chunk the outputs are a masked product (decays exp(cum_i - cum_j) for j <= i); across chunks
    a sequential pass carries the state. Returns y [n, H, P] and the final state [H, P, N].
    With ``every`` (a multiple of ``chunk_size``) the states after tokens every, 2 every, ...
    <= n are appended to ``kept``: the chunk ends the pass computes anyway."""
    n, H, P = x.shape
    G, N = B.shape[1:]
    Q = chunk_size
    if every and (every % Q or kept is None):
        raise ValueError(f"every ({every}) must be a multiple of chunk_size ({Q}), with kept")
    pad = -n % Q
    B = B.repeat_interleave(H // G, dim=1)
    C = C.repeat_interleave(H // G, dim=1)
    # Padded steps have dt = 0: decay 1 and no input, so the final state is the sequence's.
    x, dt, B, C = (torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]).unflatten(0, (-1, Q))
                   for t in (x, dt, B, C))
    cum = torch.cumsum(dt * A, dim=1)                                    # [c, Q, H]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    seg = (cum[:, :, None] - cum[:, None]).masked_fill(~causal[:, :, None], -math.inf)
    weights = torch.einsum("cihn,cjhn->cijh", C, B) * seg.exp() * dt[:, None]
    y = torch.einsum("cijh,cjhp->cihp", weights, x)
    to_end = torch.exp(cum[:, -1:] - cum) * dt                            # [c, Q, H]
    chunk_states = torch.einsum("cjh,cjhp,cjhn->chpn", to_end, x, B)      # from a zero state
    chunk_decay = cum[:, -1].exp()                                        # [c, H]
    state = x.new_zeros(H, P, N) if state is None else state.to(x.dtype)
    entering = []
    for k in range(chunk_states.shape[0]):
        entering.append(state)
        state = chunk_decay[k, :, None, None] * state + chunk_states[k]
        if every and ((k + 1) * Q) % every == 0 and (k + 1) * Q <= n:
            kept.append(state)
    y = y + torch.einsum("cihn,chpn->cihp", C, torch.stack(entering)) * cum.exp()[..., None]
    return y.flatten(0, 1)[:n], state


# ---- modules (names as transformers') ------------------------------------------------------

class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def add(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, self(h + delta)): one launch on the fused path."""
        if fused.available(h) and h.dtype == delta.dtype == self.weight.dtype:
            return fused.add_rms_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if fused.available(h):
            return fused.rms_norm(h, self.weight, self.eps)
        dtype = h.dtype
        h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class _GatedRMSNorm(_RMSNorm):
    """RMSNorm over groups of ``group_size`` channels of h * silu(gate) (gate optional: the
    decode op has applied it already)."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.group_size = group_size

    def forward(self, h: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if fused.available(h):
            return fused.rms_norm(h, self.weight, self.eps, group_size=self.group_size, gate=gate,
                                  gate_at=None if gate is None else "before")
        dtype = h.dtype
        h = h.float()
        if gate is not None:
            h = h * F.silu(gate.float())
        g = h.unflatten(-1, (-1, self.group_size))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(dtype)


class _Mamba2Mixer(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.cfg = cfg
        I, H = cfg.mamba_intermediate, cfg.mamba_num_heads
        self.in_proj = nn.Linear(cfg.hidden_size, I + cfg.conv_dim + H, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel,
                                groups=cfg.conv_dim, padding=cfg.conv_kernel - 1,
                                bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = _GatedRMSNorm(I, I // cfg.n_groups, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(I, cfg.hidden_size, bias=cfg.use_bias)

    def _split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        return self.in_proj(h).split([c.mamba_intermediate, c.conv_dim, c.mamba_num_heads], -1)

    def _conv_args(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.conv1d.weight[:, 0], self.conv1d.bias

    def _xbc_splits(self) -> list[int]:
        c = self.cfg
        GN = c.n_groups * c.ssm_state_size
        return [c.mamba_intermediate, GN, GN]

    def _xbc(self, xbc: "torch.Tensor | list[torch.Tensor]"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, B, C (heads split) of the conv's output, whole or split already."""
        c = self.cfg
        x, B, C = xbc.split(self._xbc_splits(), -1) if isinstance(xbc, torch.Tensor) else xbc
        lead = x.shape[:-1]
        return (x.reshape(*lead, c.mamba_num_heads, c.mamba_head_dim),
                B.reshape(*lead, c.n_groups, c.ssm_state_size),
                C.reshape(*lead, c.n_groups, c.ssm_state_size))

    def prefill(self, cache: ServingCache, layer: int, ctx: PrefillContext,
                h: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        z, xbc, dt = self._split(h)
        xbc = cache.conv_prefill(layer, ctx, xbc, *self._conv_args())
        x, B, C = self._xbc(xbc)
        A = -torch.exp(self.A_log.float())
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=c.time_step_min)
        kept: list[torch.Tensor] = []
        y, state = ssd_chunk_scan(x.float(), dt, A, B.float(), C.float(),
                                  ctx.chunk(c.chunk_size), cache.ssm_prefill_state(layer, ctx),
                                  ctx.block, kept)
        y = y + self.D.float()[:, None] * x.float()
        cache.ssm_prefill_end(layer, ctx, state, kept)
        y = self.norm(y.flatten(-2), z)
        return self.out_proj(y.to(h.dtype))

    def decode(self, cache: ServingCache, layer: int, ctx: DecodeContext,
               h: torch.Tensor) -> torch.Tensor:
        z, xbc, dt = self._split(h)
        # Split by the conv itself: x, B and C come out contiguous (no copies for the op).
        x, B, C = self._xbc(cache.conv_decode(layer, ctx, xbc, *self._conv_args(),
                                              splits=self._xbc_splits()))
        A, D, dt_bias = weight_constant(
            self, "decode", lambda A_log, D, dt_bias: (-torch.exp(A_log.float()),
                                                       D.float().contiguous(),
                                                       dt_bias.float().contiguous()),
            self.A_log, self.D, self.dt_bias)
        y = replayssm.mamba2_decode(
            cache.ssm, layer, ctx.slot_ids, x, dt.float().contiguous(), B, C, A, D, dt_bias)
        return self.out_proj(self.norm(y.flatten(-2), z))


class _Attention(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, Hq * D, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=False)
        self.o_proj = nn.Linear(Hq * D, cfg.hidden_size, bias=False)
        self.scale = D ** -0.5

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        D = self.cfg.head_dim
        return (self.q_proj(h).unflatten(-1, (-1, D)), self.k_proj(h).unflatten(-1, (-1, D)),
                self.v_proj(h).unflatten(-1, (-1, D)))

    def prefill(self, cache: ServingCache, layer: int, ctx: PrefillContext,
                h: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(h)
        k, v = cache.kv_prefill(layer, ctx, k, v)
        return self.o_proj(causal_attention(q, k, v, self.scale).flatten(-2))

    def decode(self, cache: ServingCache, layer: int, ctx: DecodeContext,
               h: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(h)
        cache.kv_decode(layer, ctx, k, v)
        return self.o_proj(cache.attend(layer, ctx, q, self.scale).flatten(-2))


class _MLP(nn.Module):
    def __init__(self, cfg: NemotronHConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)

    @staticmethod
    def activation(x: torch.Tensor) -> torch.Tensor:
        if fused.available(x):
            return fused.relu_square(x)
        return torch.relu(x).square()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.up_proj(h)))


class _Router(nn.Module):
    """Which experts each token goes to, and their weights (transformers' NemotronHTopkRouter;
    see the module doc). ``e_score_correction_bias`` stays in fp32 whatever the model's dtype,
    as transformers' from_pretrained keeps it: it decides between nearly equal scores, where a
    bf16 rounding of it would choose other experts."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k] (int64), weights [T, k] (fp32)) of tokens ``x`` [T, H]. Only
        device ops of fixed shapes (topk, scatter, gather): no host synchronisation."""
        c = self.cfg
        weight = weight_constant(self, "fp32", lambda w: w.float(), self.weight)
        scores = F.linear(x.float(), weight).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if c.topk_group < c.n_group:  # keeping every group is no limit
            groups = choice.unflatten(-1, (c.n_group, -1))
            group_scores = groups.topk(2, dim=-1).values.sum(-1)               # [T, n_group]
            kept = group_scores.topk(c.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
            choice = groups.masked_fill(~keep[..., None], -math.inf).flatten(-2)
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(-1, ids)  # the unbiased scores: the bias only chooses
        if c.norm_topk_prob:
            # transformers' epsilon, which only matters if every chosen score underflows.
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor


class _Experts(nn.Module):
    """The routed experts' weights, stacked as transformers holds them: ``up_proj`` [E, I, W],
    ``down_proj`` [E, W, I] (W = moe_latent_size, else hidden_size)."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        width = cfg.moe_latent_size or cfg.hidden_size
        self.up_proj = nn.Parameter(torch.empty(E, I, width))
        self.down_proj = nn.Parameter(torch.empty(E, width, I))

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # Summed in fp32 and rounded once, as transformers' experts accumulate.
        return moe.routed_experts(h, ids, weights, self.up_proj, self.down_proj, "relu2",
                                  accumulate=torch.float32)


class _MoE(nn.Module):
    """A mixture-of-experts mixer: routed experts (inside the latent projections, when the
    config has them) plus the shared expert, both of the block's normed input."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.gate = _Router(cfg)
        self.experts = _Experts(cfg)
        self.shared_experts = _MLP(cfg, cfg.moe_shared_expert_intermediate_size)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if cfg.moe_latent_size is not None:
            L = cfg.moe_latent_size
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, L, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(L, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, -2)  # prefill's [n, H] or a decode window's [B, T, H]
        ids, weights = self.gate(tokens)
        h = tokens if self.fc1_latent_proj is None else self.fc1_latent_proj(tokens)
        routed = self.experts(h, ids, weights)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed.view_as(x) + self.shared_experts(x)


_MIXERS = {_MAMBA_LAYER: _Mamba2Mixer, _ATTENTION_LAYER: _Attention, _MLP_LAYER: _MLP,
           _MOE_LAYER: _MoE}
# Mixers without state: the stack calls them directly.
_STATELESS = (_MLP_LAYER, _MOE_LAYER)


class _Block(nn.Module):
    def __init__(self, cfg: NemotronHConfig, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.index = index  # among the cache's layers of its kind (SSM or attention)
        self.norm = _RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = _MIXERS[kind](cfg)


class _Backbone(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        counts = dict.fromkeys(_MIXERS, 0)
        blocks = []
        for kind in cfg.pattern:
            blocks.append(_Block(cfg, kind, counts[kind]))
            counts[kind] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm_f = _RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class NemotronHModel(HybridModel):
    """A Nemotron-H decoder (see the module doc) with transformers' weight names:
    ``model.embeddings``, ``model.layers.{i}.norm``, ``model.layers.{i}.mixer.*``,
    ``model.norm_f``, ``lm_head`` (hub checkpoints' ``backbone.`` prefix is read as ``model.``)."""

    config_class = NemotronHConfig
    ignored_tensors = ("mtp.",)  # multi-token-prediction heads, which transformers skips too

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tie()

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def random(cls, config: "NemotronHConfig | dict", seed: int = 0, device: Any = "cpu",
               dtype: torch.dtype = torch.float32) -> "NemotronHModel":
        """Seeded random weights at activations of order one: projections N(0, 1/fan_in) (the
        experts' stacked ones too, per expert; the router's, so that its logits are of order
        one and tokens choose different experts), embeddings N(0, 1), norms 1 + N(0, 0.1^2),
        A_log = log(1..H), D near 1, dt_bias the inverse softplus of dt log-uniform in
        [time_step_min, time_step_max] (transformers' Mamba-2 initialisation), biases and the
        router's score-correction bias N(0, 0.1^2) (a shift of the choice comparable to the
        sigmoid scores' spread, so it changes some choices and not all)."""
        config = cls._config(config)
        model = cls._empty(config, device, dtype)
        gen = torch.Generator(device=torch.device(device)).manual_seed(seed)

        def fill(p: torch.Tensor, values: torch.Tensor) -> None:
            p.copy_(values.to(p.dtype))

        def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device=device) * std

        def uniform(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.rand(shape, generator=gen, device=device)

        H, cfg = config.mamba_num_heads, config
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                fill(p, 1 + normal(p.shape, 0.1))
            elif leaf == "A_log":
                fill(p, torch.log(torch.arange(1, H + 1, device=device, dtype=torch.float32)))
            elif leaf == "D":
                fill(p, 1 + normal(p.shape, 0.1))
            elif leaf == "dt_bias":
                lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
                dt = torch.exp(lo + uniform(p.shape) * (hi - lo)).clamp(min=cfg.time_step_floor)
                fill(p, dt + torch.log(-torch.expm1(-dt)))
            elif "embeddings" in name:
                fill(p, normal(p.shape, 1.0))
            elif name.endswith("conv1d.weight"):
                fill(p, normal(p.shape, cfg.conv_kernel ** -0.5))
            elif leaf in ("bias", "e_score_correction_bias"):
                fill(p, normal(p.shape, 0.1))
            else:  # projections [out, in], and the experts' [E, out, in]
                fill(p, normal(p.shape, p.shape[-1] ** -0.5))
        return model

    @classmethod
    def _empty(cls, config: NemotronHConfig, device: Any, dtype: torch.dtype) -> "NemotronHModel":
        model = super()._empty(config, device, dtype)
        for block in model.model.layers:
            if block.kind == _MOE_LAYER:  # the score-correction bias stays fp32 (see _Router)
                gate = block.mixer.gate
                gate.e_score_correction_bias = nn.Parameter(
                    gate.e_score_correction_bias.detach().float(), requires_grad=False)
        return model

    @classmethod
    def from_tensors(cls, config: "NemotronHConfig | dict", tensors: dict[str, torch.Tensor],
                     device: Any = "cpu", dtype: torch.dtype = torch.float32) -> "NemotronHModel":
        """:meth:`HybridModel.from_tensors`, the experts stored either stacked (transformers'
        in-memory names, ``mixer.experts.up_proj``) or one tensor per expert (the hub's and
        ``save_pretrained``'s: ``mixer.experts.{e}.up_proj.weight``), which are stacked here
        (refusing a missing or mis-shaped expert by its name)."""
        config = cls._config(config)
        return super().from_tensors(config, _stack_experts(config, tensors), device, dtype)

    @classmethod
    def _checkpoint_names(cls, names: list[str], tensors: dict[str, torch.Tensor]
                          ) -> dict[str, str]:
        """The hub's checkpoints name the backbone ``backbone.*`` (transformers: ``model.*``)."""
        hub = any(k.startswith(_HUB_PREFIX) for k in tensors)
        return {k: (_HUB_PREFIX + k[len("model."):] if hub and k.startswith("model.") else k)
                for k in names}

    # ---- serving ------------------------------------------------------------------------------

    def cache_layout(self) -> CacheLayout:
        c = self.config
        w = self.model.embeddings.weight
        return CacheLayout(
            ssm_kind="mamba2",
            ssm_dims=dict(num_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim,
                          state_dim=c.ssm_state_size, num_groups=c.n_groups),
            num_ssm_layers=c.pattern.count(_MAMBA_LAYER), conv_channels=c.conv_dim,
            conv_kernel=c.conv_kernel, num_attn_layers=c.pattern.count(_ATTENTION_LAYER),
            kv_heads=c.num_key_value_heads, head_dim=c.head_dim, device=w.device, dtype=w.dtype)

    def _stack(self, tokens: torch.Tensor, positions: torch.Tensor, mix: Any) -> torch.Tensor:
        # No rotary embedding: positions are unused.
        h = self.model.embeddings(tokens).to(self.model.norm_f.weight.dtype)
        delta = None  # each block's update, added to h by the next norm (one fused launch)
        for block in self.model.layers:
            if delta is None:
                x = block.norm(h)
            else:
                h, x = block.norm.add(h, delta)
            delta = (block.mixer(x) if block.kind in _STATELESS
                     else mix(block.mixer, block.index, x))
        return self.lm_head(self.model.norm_f.add(h, delta)[1])
