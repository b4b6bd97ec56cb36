"""The Qwen3-Next family (transformers' ``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B), with
its weight names, served from a :class:`ServingCache`: Qwen3.5-MoE's layers
(:mod:`replayssm.models.qwen3_5`) with the differences below, everything else reused from
there (norms, attention, rotary, the gated delta rule, the sparse block, the loader's expert
stacking, the GDN state layout and the cache calls).

* Gated DeltaNet input projections: two fused ones instead of four. ``in_proj_qkvz`` gives,
  per key head g, [q_g (K), k_g (K), v_g (r V), z_g (r V)] (r = num_v_heads / num_k_heads:
  the value heads g r .. g r + r - 1 read key head g, as in Qwen3.5), and ``in_proj_ba``
  per key head [b_g (r), a_g (r)]. The computation after the split is Qwen3.5's.
* Rotary: plain RoPE on the first ``partial_rotary_factor * head_dim`` dims (no M-RoPE
  sections; Qwen3.5's reduces to the same for text).
* MLPs: a sparse block where transformers puts one (``mlp_is_sparse``: not in
  ``mlp_only_layers``, ``num_experts > 0`` and (layer + 1) a multiple of
  ``decoder_sparse_step``), else a dense SwiGLU MLP of ``intermediate_size``; the top-k
  weights are divided by their sum only with ``norm_topk_prob`` (true in the 80B).

The fused projections are de-interleaved once, when weights are loaded: the GDN's
``in_proj_qkvz.weight`` / ``in_proj_ba.weight`` parameters hold their rows in Qwen3.5's order
([q of all key heads, k, v, z] and [b, a]), so one GEMM's output splits into the conv's input
(q, k, v channels contiguous, as the conv ring and ``gdn_decode`` take them), z, b and a by
column slices, as in Qwen3.5: a decode step copies nothing for the layout and stays
capturable, and the weights are held once. Splitting per key head at run time instead would
gather q, k and v into a new [tokens, conv_dim] tensor in every layer of every step.
Checkpoint-facing views keep transformers' row order: :meth:`Qwen3NextModel.from_tensors`
(and ``from_pretrained``, ``load_state_dict``) de-interleave, ``state_dict()`` interleaves
back, so checkpoints, ``save_pretrained`` output and transformers' modules see their own
layout. Reading ``model...linear_attn.in_proj_qkvz.weight`` directly gives our order.

Not implemented (refused by name where a config.json sets them): rotary scaling (rope_type
other than default), activations other than SiLU; the multi-token-prediction head (``mtp.*``
tensors) is skipped, as transformers does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from .merged import MergedLinear
from .qwen3_5 import Qwen35MoeConfig, Qwen35MoeModel, _GatedDeltaNet, tiny_moe_config

__all__ = ["Qwen3NextConfig", "Qwen3NextModel", "QWEN3_NEXT_80B_A3B", "tiny_next_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(Qwen35MoeConfig):
    """A Qwen3-Next checkpoint's config (transformers' ``Qwen3NextConfig`` fields, by the same
    names, and its defaults for a config.json that leaves a field out). Layers are given by
    ``layer_types`` or, without it, by ``full_attention_interval`` (every 4th layer full
    attention by default). :data:`QWEN3_NEXT_80B_A3B` is the 80B-A3B layout;
    :func:`tiny_next_config` gives test-sized ones."""

    vocab_size: int = 151_936
    hidden_size: int = 2048
    #: The dense MLP's width, in the layers without a sparse block (none in the 80B).
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    model_type: ClassVar[str] = "qwen3_next"
    hf_model_types: ClassVar[tuple[str, ...]] = ("qwen3_next",)
    architecture: ClassVar[str] = "Qwen3NextForCausalLM"

    def __post_init__(self) -> None:
        # A config.json's list (or null, which transformers reads as none).
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step {self.decoder_sparse_step} must be >= 1 "
                             f"(a sparse block every that many layers)")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(f"mlp_only_layers {outside} are not layers of "
                             f"{self.num_hidden_layers}")
        super().__post_init__()
        dense = [i for i in range(self.num_hidden_layers) if not self.mlp_is_sparse(i)]
        if dense and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size {self.intermediate_size} must be positive: "
                             f"layers {dense} have a dense MLP")

    def mlp_is_sparse(self, layer: int) -> bool:
        """transformers' rule: a sparse block unless the layer is in ``mlp_only_layers``,
        there are no experts, or (layer + 1) is not a multiple of ``decoder_sparse_step``."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict (what ``transformers.Qwen3NextConfig(**d)`` takes): plain
        RoPE, so no M-RoPE sections."""
        d = super().to_hf()
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["rope_parameters"] = {k: v for k, v in d["rope_parameters"].items()
                                if not k.startswith("mrope")}
        return d


#: The Qwen3-Next-80B-A3B layout (Instruct and Thinking share it). Sources, each number from at
#: least one: (a) a public copy of Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (a model
#: listing in the search index's code corpus, its first fields): decoder_sparse_step 1,
#: full_attention_interval 4, head_dim 256, hidden_size 2048, intermediate_size 5120,
#: linear_conv_kernel_dim 4, linear_key_head_dim 128, linear_num_key_heads 16,
#: linear_num_value_heads 32, linear_value_head_dim 128, max_position_embeddings 262144,
#: mlp_only_layers [], moe_intermediate_size 512; (b) the model card (as mirrored publicly):
#: 48 layers, hidden 2048, layout 12 x (3 x (Gated DeltaNet -> MoE) + (Gated Attention -> MoE)),
#: attention 16 query heads, 2 KV heads, head dim 256, rotary dim 64 (partial_rotary_factor
#: 0.25), GDN 32 value heads and 16 query/key heads of dim 128, 512 experts, 10 routed and
#: 1 shared, expert width 512, context 262144; (c) a public test fixture's notes on the
#: release's config.json (revision 9c7f2fbe): rope_theta 1e7, partial_rotary_factor 0.25,
#: mlp_only_layers [], decoder_sparse_step 1, norm_topk_prob true, rms_norm_eps 1e-6, untied
#: embeddings, 16:2 heads. Unverified against the file itself: vocab_size 151936 and
#: shared_expert_intermediate_size 512 (transformers' Qwen3NextConfig defaults, documented as
#: the 80B-A3B-Instruct's, and the values in public copies of Qwen3-Coder-Next's config.json,
#: the same architecture; the card's "1 shared" expert of the experts' width). The MTP head
#: (``mtp.*``) is left out: a text decoder does not run it.
QWEN3_NEXT_80B_A3B = Qwen3NextConfig(
    vocab_size=151_936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=(), rms_norm_eps=1e-6, rope_theta=10_000_000.0,
    partial_rotary_factor=0.25, max_position_embeddings=262_144, tie_word_embeddings=False)


def tiny_next_config(**overrides: Any) -> Qwen3NextConfig:
    """:func:`~replayssm.models.qwen3_5.tiny_moe_config`'s layout (grouped GDN heads with
    K != V, so that the fused projections' per-key-head order matters; GQA; 8 experts, 3 per
    token) as a Qwen3-Next config, with a dense MLP width for the layers that
    ``mlp_only_layers`` / ``decoder_sparse_step`` make dense (none by default, as in the 80B)."""
    kw = dataclasses.asdict(tiny_moe_config())
    kw.update(intermediate_size=80)
    kw.update(overrides)
    return Qwen3NextConfig(**kw)


# ---- the fused GDN projections -----------------------------------------------------------------

def _checkpoint_rows(c: Qwen3NextConfig) -> dict[str, torch.Tensor]:
    """For each fused projection (by parameter name), the checkpoint row each of our rows
    holds: ours[i] = checkpoint[rows[i]]. transformers' rows run key head by key head,
    [q_g, k_g, v_g, z_g] and [b_g, a_g]; ours run part by part, every key head's q, then k, ..."""
    Hk, K, V = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // Hk

    def arange(n: int) -> torch.Tensor:
        # On the CPU even where a model is built on the meta device (moved where used).
        return torch.arange(n, device="cpu")

    def parts(group_width: int, widths: list[int]) -> torch.Tensor:
        start = arange(Hk)[:, None] * group_width
        out, offset = [], 0
        for w in widths:
            out.append((start + offset + arange(w)).reshape(-1))
            offset += w
        return torch.cat(out)

    return {"in_proj_qkvz.weight": parts(2 * K + 2 * r * V, [K, K, r * V, r * V]),
            "in_proj_ba.weight": parts(2 * r, [r, r])}


def _reorder(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return t.index_select(0, rows.to(t.device))


class _FusedGatedDeltaNet(_GatedDeltaNet):
    """Qwen3.5's GDN mixer reading x through Qwen3-Next's two fused projections, whose rows it
    holds de-interleaved (module docstring): ``project`` gives Qwen3.5's (conv input, z, b,
    a) as column slices of one GEMM; the rest is inherited."""

    def _input_projections(self, c: Qwen3NextConfig) -> None:
        self.in_proj_qkvz = nn.Linear(c.hidden_size, c.conv_dim + c.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(c.hidden_size, 2 * c.linear_num_value_heads, bias=False)
        self._in_proj = MergedLinear(self.in_proj_qkvz, self.in_proj_ba)
        self._rows = _checkpoint_rows(c)
        self.register_state_dict_post_hook(_interleave_state)
        self.register_load_state_dict_pre_hook(_deinterleave_state)

    def project(self, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.c
        qkvz, ba = self._in_proj(x)
        mixed, z = qkvz.split([c.conv_dim, c.value_dim], -1)
        b, a = ba.split([c.linear_num_value_heads] * 2, -1)
        return mixed, z, b, a


def _interleave_state(module: _FusedGatedDeltaNet, state: dict, prefix: str, meta: Any) -> None:
    """state_dict(): the fused projections in the checkpoint's (transformers') row order."""
    for name, rows in module._rows.items():
        if prefix + name in state:
            state[prefix + name] = _reorder(state[prefix + name], torch.argsort(rows))


def _deinterleave_state(module: _FusedGatedDeltaNet, state: dict, prefix: str, *_: Any) -> None:
    """load_state_dict(): checkpoint rows to ours (a mis-shaped tensor is left for
    load_state_dict to refuse)."""
    for name, rows in module._rows.items():
        t = state.get(prefix + name)
        if t is not None and t.shape[0] == rows.numel():
            state[prefix + name] = _reorder(t, rows)


def _deinterleave(c: Qwen3NextConfig, tensors: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with every GDN layer's fused projections in our row order; a
    mis-shaped one passes unchanged, for the shape check to refuse by name."""
    rows = _checkpoint_rows(c)
    out = dict(tensors)
    for i in c.ssm_layers:
        for name, order in rows.items():
            key = f"model.layers.{i}.linear_attn.{name}"
            t = tensors.get(key)
            if t is not None and t.dim() == 2 and t.shape[0] == order.numel():
                out[key] = _reorder(t, order)
    return out


# ---- the model ---------------------------------------------------------------------------------

class Qwen3NextModel(Qwen35MoeModel):
    """A Qwen3-Next decoder (``Qwen3NextForCausalLM``'s computation and weight names) served
    from a :class:`ServingCache`: Qwen3.5-MoE's model with the fused GDN projections, plain
    RoPE and dense MLPs where the config puts them. Checkpoints' experts may be stacked or
    per expert (stacked on load, as Qwen3.5-MoE's)."""

    config_class = Qwen3NextConfig
    ignored_tensors = ("mtp.",)
    gdn_class: ClassVar[type] = _FusedGatedDeltaNet

    @classmethod
    def from_tensors(cls, config: Any, tensors: dict[str, torch.Tensor], device: Any = "cpu",
                     dtype: torch.dtype = torch.float32) -> "Qwen3NextModel":
        """:meth:`Qwen35MoeModel.from_tensors` over transformers-ordered tensors: the fused
        GDN projections are de-interleaved first (module docstring)."""
        config = cls._config(config)
        return super().from_tensors(config, _deinterleave(config, tensors), device=device,
                                    dtype=dtype)

