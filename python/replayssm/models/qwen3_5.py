"""The Qwen3.5 family: Gated DeltaNet mixers with a gated full-attention layer every few layers,
each followed by a SwiGLU MLP — the computation of transformers' ``Qwen3_5ForCausalLM``, with
its weight names, served from a :class:`ServingCache` — and Qwen3.5-MoE
(``Qwen3_5MoeForCausalLM``: Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B), the same layers with a
sparse block as every MLP (:class:`Qwen35MoeConfig`, :class:`Qwen35MoeModel`). Norms, mixers
and rotary are the same in both (transformers' MoE classes compute them identically).
Qwen3-Next (:mod:`replayssm.models.qwen3_next`) is built from these layers too: the GDN mixer
reads x through other projections (``_input_projections``), a config decides which layers'
MLPs are sparse (``mlp_is_sparse``) and whether the top-k weights are renormalised.

One decoder layer (pre-norm, residual around the mixer and around the MLP)::

    h = x + mixer(rmsnorm(x));   out = h + mlp(rmsnorm(h))

* RMSNorm scales by ``1 + weight`` (weights stored zero-centred), in fp32, rounded once.
* Gated DeltaNet (``linear_attn``): ``in_proj_qkv`` -> depthwise causal conv1d (kernel 4, no bias)
  -> SiLU -> q, k [num_k_heads, head_k_dim], v [num_v_heads, head_v_dim]; value head h reads key
  head h // (num_v_heads / num_k_heads); ``beta = sigmoid(in_proj_b x)``,
  ``g = -exp(A_log) * softplus(in_proj_a x + dt_bias)``; the gated delta rule over q, k
  L2-normalised (eps 1e-6 under the root) and q scaled by head_k_dim ** -0.5; then
  ``norm(o, z)`` = weight * rmsnorm(o) * silu(z) per value head (a plain weight, not 1 + w;
  ``z = in_proj_z x``) and ``out_proj``.
* Gated attention (``self_attn``): ``q_proj`` gives, per head, the query then an output gate;
  RMSNorm (1 + w) over head_dim on q and k; rotary embedding on the first
  ``partial_rotary_factor * head_dim`` dims (rotate-half pairing); GQA softmax attention with
  scale head_dim ** -0.5; output * sigmoid(gate); ``o_proj``. The checkpoint's rotary is
  interleaved M-RoPE over (temporal, height, width) sections; text tokens carry the same
  position in all three, so it reduces to plain RoPE with the same inverse frequencies.
* Sparse block (MoE ``mlp``): router ``gate`` (linear, no bias) -> softmax in fp32 -> top
  ``num_experts_per_tok`` -> weights divided by their sum -> rounded to the activations'
  dtype; the chosen experts (SwiGLU, ``experts.gate_up_proj`` [E, 2I, H], ``down_proj``
  [E, H, I]) through :func:`replayssm.models.moe.routed_experts`, weighted and summed in the
  activations' dtype; plus ``shared_expert`` (a SwiGLU MLP) times
  sigmoid(``shared_expert_gate`` x). Checkpoints with the experts stored one by one (what
  ``save_pretrained`` writes) are stacked on load.

The recurrent state of a GDN layer is carried as the library holds it, ``[num_v_heads,
head_v_dim, head_k_dim]`` (transformers keeps its transpose). Prefill runs the chunked form of
the gated delta rule (:func:`gated_delta_chunked`) in fp32, from the slot's state when it
continues one, and hands the final state to the cache (``ServingCache.ssm_hand_off`` loads
every layer's at the end); decode calls :func:`replayssm.gdn_decode`, whose q/k contract
(``qk_l2norm=True``: L2 norm with eps 1e-6 under the root, then ``scale`` = head_k_dim ** -0.5)
is the one above.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import replayssm

from . import fused
from .merged import MergedLinear
from .loader import stack_tensors
from .moe import routed_experts
from .base import (CacheLayout, DecodeContext, HybridModel, PrefillContext, ServingCache,
                   causal_attention)

__all__ = ["Qwen35Config", "Qwen35Model", "Qwen35MoeConfig", "Qwen35MoeModel",
           "gated_delta_chunked", "QWEN35_4B", "QWEN35_MOE_35B_A3B", "tiny_config",
           "tiny_moe_config"]

LINEAR, FULL = "linear_attention", "full_attention"
#: Where a published Qwen3.5 checkpoint (the multimodal model) keeps the text decoder.
_TOWER_PREFIX = "model.language_model."
_LEGACY_LAYER_TYPES = {"mamba": LINEAR, "attention": FULL}
#: The prefill scan's chunk length (a prefill keeping block states takes its gcd with the block).
_SCAN_CHUNK = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen35Config:
    """The text tower of a Qwen3.5 checkpoint (transformers' ``Qwen3_5TextConfig`` fields, by
    the same names). :data:`QWEN35_4B` is the Qwen3.5-4B layout; :func:`tiny_config` gives
    test-sized ones."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    rms_norm_eps: float = 1e-6
    # Defaults: Qwen3_5TextConfig's, for a config.json that leaves a field out.
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32_768
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    #: config.json's model_type of the text tower (what ``Qwen3_5ForCausalLM`` saves); the
    #: published checkpoints' ``qwen3_5`` wraps it in ``text_config``.
    model_type: ClassVar[str] = "qwen3_5_text"
    #: Every model_type a config.json of this layout may carry (the text tower's, the published
    #: wrapper's), and the class to_hf names in ``architectures``.
    hf_model_types: ClassVar[tuple[str, ...]] = ("qwen3_5_text", "qwen3_5")
    architecture: ClassVar[str] = "Qwen3_5ForCausalLM"

    def __post_init__(self) -> None:
        if not self.layer_types:
            # transformers' default: every full_attention_interval-th layer is full attention.
            types = tuple(FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR
                          for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        # Older configs' names, which transformers maps the same way.
        object.__setattr__(self, "layer_types",
                           tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise ValueError(f"unknown layer types {unknown}; choose {LINEAR!r} or {FULL!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; Qwen3.5 uses 'silu'")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives rotary "
                             f"dim {self.rotary_dim}; it must be even and in (0, head_dim]")

    # ---- derived sizes ----------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def ssm_layers(self) -> list[int]:
        """Indices of the Gated DeltaNet layers, in order (their index in the SSM cache is their
        position in this list)."""
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    def mlp_is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a sparse block (else a dense SwiGLU MLP of
        ``intermediate_size``): never in Qwen3.5."""
        return False

    @property
    def gdn_dims(self) -> dict[str, int]:
        """The SSM layers' shape as :class:`replayssm.CacheConfig` takes it."""
        return dict(num_k_heads=self.linear_num_key_heads, num_v_heads=self.linear_num_value_heads,
                    head_k_dim=self.linear_key_head_dim, head_v_dim=self.linear_value_head_dim)

    # ---- Hugging Face config.json -------------------------------------------------------
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen35Config":
        """From a config.json dict of one of ``hf_model_types``: the text tower's (what
        ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` saves) or the published checkpoints'
        (the text tower under ``text_config``). Refuses another model_type (a MoE layout read
        as a dense one, or the reverse) by name."""
        text = dict(config.get("text_config") or config)
        for declared in sorted({config.get("model_type"), text.get("model_type")} - {None}):
            if declared not in cls.hf_model_types:
                raise ValueError(f"model_type {declared!r} is not a {cls.__name__} layout "
                                 f"({', '.join(cls.hf_model_types)}); models.load picks the "
                                 f"family by model_type")
        rope = dict(text.get("rope_parameters") or {})
        # Older config.json files name a scaled rotary rope_scaling (its kind under "type" or
        # "rope_type"); null there, as in the published checkpoints, is plain RoPE.
        for given in (rope, dict(text.get("rope_scaling") or {})):
            kind = given.get("rope_type", given.get("type", "default"))
            if kind != "default":
                raise ValueError(f"unsupported rope_type {kind!r}; only 'default'")
        if not text.get("attn_output_gate", True):
            raise ValueError("attention without the output gate (attn_output_gate false) is not "
                             "Qwen3.5's")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in text.items() if k in fields}
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope:
                kw[key] = rope[key]
        # A published checkpoint ties (or not) its LM head at the top level, as
        # Qwen3_5ForConditionalGeneration reads it.
        if "text_config" in config and "tie_word_embeddings" in config:
            kw["tie_word_embeddings"] = config["tie_word_embeddings"]
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict of this layout, of the text tower's model_type (what
        transformers' ``Qwen3_5TextConfig(**d)``, or ``Qwen3_5MoeTextConfig(**d)``, takes)."""
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d.pop("full_attention_interval")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
                                "partial_rotary_factor": d.pop("partial_rotary_factor"),
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
        d["model_type"] = self.model_type
        d["architectures"] = [self.architecture]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_hf(), indent=2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen35MoeConfig(Qwen35Config):
    """The text tower of a Qwen3.5-MoE checkpoint (transformers' ``Qwen3_5MoeTextConfig``):
    Qwen3.5's layers with every MLP a sparse block of ``num_experts`` routed experts (each a
    SwiGLU MLP of ``moe_intermediate_size``; a token takes ``num_experts_per_tok`` of them) and
    one shared expert of ``shared_expert_intermediate_size``. Defaults are transformers' (the
    Qwen3.5-35B-A3B numbers), for a config.json that leaves a field out.
    :data:`QWEN35_MOE_35B_A3B` is that layout; :func:`tiny_moe_config` gives test-sized ones."""

    #: Unused: no layer has a dense MLP (transformers' MoE config has no such field); kept only
    #: when a config.json carries it.
    intermediate_size: int | None = None
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    #: Qwen3.5-MoE always divides the top-k weights by their sum (Qwen3-Next's config, a
    #: subclass, makes this a field).
    norm_topk_prob: ClassVar[bool] = True

    model_type: ClassVar[str] = "qwen3_5_moe_text"
    hf_model_types: ClassVar[tuple[str, ...]] = ("qwen3_5_moe_text", "qwen3_5_moe")
    architecture: ClassVar[str] = "Qwen3_5MoeForCausalLM"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not any(self.mlp_is_sparse(i) for i in range(self.num_hidden_layers)):
            return  # no sparse block: the MoE fields are unused (Qwen3-Next allows that)
        if self.num_experts < 1:
            raise ValueError(f"num_experts {self.num_experts}: a sparse block needs experts")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                             f"[1, num_experts = {self.num_experts}]")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be positive (a "
                                 f"sparse block has routed experts and a shared expert)")

    def mlp_is_sparse(self, layer: int) -> bool:
        """Every Qwen3.5-MoE layer's MLP is a sparse block."""
        return True

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen35MoeConfig":
        """As :meth:`Qwen35Config.from_hf`; also refuses the Qwen3-Next routing options that
        Qwen3.5-MoE dropped (transformers' Qwen3.5-MoE renormalises the top-k weights and has
        a sparse block in every layer) when a config.json sets them otherwise, unless the
        class has them as fields (Qwen3-Next's config, which reads them). The model_type is
        checked first: a Qwen3-Next config.json is refused as such."""
        parsed = super().from_hf(config)
        text = config.get("text_config") or config
        fields = {f.name for f in dataclasses.fields(cls)}
        if "norm_topk_prob" not in fields and not text.get("norm_topk_prob", True):
            raise ValueError("norm_topk_prob false: Qwen3.5-MoE renormalises the top-k weights")
        if "mlp_only_layers" not in fields and (text.get("mlp_only_layers") or
                                                text.get("decoder_sparse_step", 1) != 1):
            raise ValueError("mlp_only_layers / decoder_sparse_step: Qwen3.5-MoE has a sparse "
                             "block in every layer")
        return parsed

    def to_hf(self) -> dict[str, Any]:
        d = super().to_hf()
        if d["intermediate_size"] is None:
            del d["intermediate_size"]
        return d


#: The Qwen3.5-4B layout (the layer benchmark's ``qwen35-4b`` GDN shape: 16 key heads, 32 value
#: heads, K = V = 128). Every number is the ``text_config`` of Qwen/Qwen3.5-4B's config.json on
#: the Hugging Face Hub, as public tooling reproduces it (e.g. THUDM/slime
#: scripts/models/qwen3.5-4B.sh, derived from that file):
#: hidden_size 2560, intermediate_size 9216, 32 layers, layer_types three linear_attention then
#: one full_attention, eight times (full_attention_interval 4: full at 3, 7, ..., 31);
#: attention 16 heads, 4 KV heads, head_dim 256, no bias, output gate; GDN 16 key heads,
#: 32 value heads, head_k_dim = head_v_dim = 128, conv kernel 4; rms_norm_eps 1e-6;
#: rope_theta 1e7, partial_rotary_factor 0.25 (64 rotary dims; M-RoPE sections [11, 11, 10],
#: interleaved); vocab 248320; max_position_embeddings 262144; tie_word_embeddings true (the
#: 4B ties its LM head to the embedding; the 27B does not).
#: Assumption: the multi-token-prediction head (``mtp.*``, one layer) and the vision tower are
#: left out: a text decoder does not run them.
QWEN35_4B = Qwen35Config(
    vocab_size=248_320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    rms_norm_eps=1e-6, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
    max_position_embeddings=262_144, tie_word_embeddings=True)


def tiny_config(**overrides: Any) -> Qwen35Config:
    """A test-sized layout with the real one's structure: grouped GDN heads (2 value heads per
    key head), GQA attention (2 query heads per KV head), partial rotary, K != V, and a layer
    pattern that starts and ends with GDN layers around two attention layers."""
    kw: dict[str, Any] = dict(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=(LINEAR, LINEAR, FULL, LINEAR, FULL, LINEAR),
        partial_rotary_factor=0.5, max_position_embeddings=4096,
        tie_word_embeddings=False)
    kw.update(overrides)
    return Qwen35Config(**kw)


#: The Qwen3.5-35B-A3B layout (Qwen3.5-MoE; also Qwen3.6-35B-A3B's, which shares the
#: architecture). Numbers: the ``text_config`` of Qwen/Qwen3.5-35B-A3B's config.json on the
#: Hugging Face Hub, as public tooling reproduces it (THUDM/slime
#: scripts/models/qwen3.5-35B-A3B.sh, derived from that file, and configs copied from it in
#: other public test suites): hidden_size 2048, 40 layers, three linear_attention then one
#: full_attention, ten times (full at 3, 7, ..., 39); attention 16 heads, 2 KV heads,
#: head_dim 256, no bias, output gate; GDN 16 key heads, 32 value heads, K = V = 128, conv
#: kernel 4; 256 experts, 8 per token, moe_intermediate_size 512, one shared expert of 512
#: with its sigmoid gate; rms_norm_eps 1e-6; rope_theta 1e7, partial_rotary_factor 0.25
#: (M-RoPE sections [11, 11, 10]); vocab 248320; tie_word_embeddings false (slime's
#: --untie-embeddings-and-output-weights); max_position_embeddings 262144 (the model card's
#: native context; the one number not read from a copy of the file itself).
#: transformers' Qwen3_5MoeTextConfig defaults agree on every MoE field and on hidden_size,
#: layers, heads and vocab. As for the 4B, the MTP head and the vision tower are left out.
QWEN35_MOE_35B_A3B = Qwen35MoeConfig(
    vocab_size=248_320, hidden_size=2048, num_hidden_layers=40,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    rms_norm_eps=1e-6, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
    max_position_embeddings=262_144, tie_word_embeddings=False)


def tiny_moe_config(**overrides: Any) -> Qwen35MoeConfig:
    """:func:`tiny_config`'s layout with sparse blocks: 8 experts, 3 per token (so a token's
    choice varies and some experts go unchosen in a step), expert and shared-expert widths
    that differ from each other and from the hidden size."""
    kw = dataclasses.asdict(tiny_config())
    del kw["intermediate_size"]
    kw.update(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
              shared_expert_intermediate_size=40)
    kw.update(overrides)
    return Qwen35MoeConfig(**kw)


# ---- the chunked gated delta rule (prefill) ----------------------------------------------------

def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor | None = None,
                        chunk: int = 64, every: int = 0, kept: list[torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a whole sequence, chunk by chunk, in fp32.

    ``q``, ``k`` [n, H, K] (one per value head; raw: L2-normalised here, q scaled by
    K ** -0.5), ``v`` [n, H, V], ``g`` (log-decay, <= 0), ``beta`` [n, H]; ``state`` [H, V, K]
    (None: zeros). Returns (o [n, H, V], final state [H, V, K]), both fp32. Per token, with
    S [V, K]:

        S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t.

    Within a chunk of C tokens starting from S_0, with c_i = sum_{j<=i} g_j, the writes
    d_i = beta_i (v_i - exp(g_i) S_{i-1} k_i) solve the unit lower-triangular system
    (I + A) D = beta V - diag(beta e^c) K S_0^T,  A_ij = beta_i e^(c_i - c_j) k_i.k_j (j < i);
    then O = diag(e^c) Q S_0^T + (Q K^T o e^(c_i - c_j), j <= i) D and
    S_C = e^(c_C) S_0 + D^T diag(e^(c_C - c)) K: one triangular solve and a few matmuls per
    chunk instead of C rank-one updates. Only differences c_i - c_j <= 0 are exponentiated
    besides e^c itself, so no factor overflows however strong the decay.

    With ``every`` (a multiple of ``chunk``) the states after tokens every, 2 every, ... <= n
    are appended to ``kept``: chunk ends the loop passes anyway.
    """
    n, H, K = k.shape
    V = v.shape[-1]
    if every and (every % chunk or kept is None):
        raise ValueError(f"every ({every}) must be a multiple of chunk ({chunk}), with kept")
    f32 = torch.float32
    q = _l2norm(q.to(f32)) * K ** -0.5
    k = _l2norm(k.to(f32))
    v, g, beta = v.to(f32), g.to(f32), beta.to(f32)
    S = (torch.zeros(H, V, K, dtype=f32, device=v.device) if state is None
         else state.to(f32).clone())
    out = torch.empty(n, H, V, dtype=f32, device=v.device)
    # Heads first: [H, C, .] blocks batch over heads.
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)
    for s0 in range(0, n, chunk):
        s1 = min(s0 + chunk, n)
        C = s1 - s0
        qc, kc, vc, bc = q[:, s0:s1], k[:, s0:s1], v[:, s0:s1], beta[:, s0:s1]
        c = g[:, s0:s1].cumsum(-1)                                   # [H, C]
        diff = c[:, :, None] - c[:, None, :]                         # c_i - c_j
        lower = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
        # exp only where j <= i (there the difference is <= 0), so nothing overflows.
        decay = torch.where(lower, diff, torch.full_like(diff, -math.inf)).exp()
        kk = kc @ kc.transpose(-1, -2)                               # k_i . k_j
        A = (bc[:, :, None] * kk * decay).tril(-1)
        eye = torch.eye(C, dtype=f32, device=v.device)
        rhs = bc[:, :, None] * vc - (bc * c.exp())[:, :, None] * (kc @ S.transpose(-1, -2))
        D = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        out[s0:s1] = (c.exp()[:, :, None] * (qc @ S.transpose(-1, -2))
                      + ((qc @ kc.transpose(-1, -2)) * decay) @ D).transpose(0, 1)
        last = c[:, -1:]                                             # c_C
        S = last.exp()[:, :, None] * S + D.transpose(-1, -2) @ ((last - c).exp()[:, :, None] * kc)
        if every and s1 % every == 0:
            kept.append(S)
    return out, S


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + 1e-6) over the last axis: the normalisation gdn_decode applies with
    qk_l2norm=True (and transformers' Qwen3.5 with use_qk_l2norm_in_kernel)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# ---- layers ------------------------------------------------------------------------------------

class _RMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight: x / rms(x) * (1 + weight), in fp32, rounded once to
    x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def add(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, self(h + delta)): one launch on the fused path."""
        if fused.available(h) and h.dtype == delta.dtype:
            return fused.add_rms_norm(h, delta, self.weight, self.eps, one_plus=True)
        h = h + delta
        return h, self(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.available(x):
            return fused.rms_norm(x, self.weight, self.eps, one_plus=True)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class _GatedRMSNorm(nn.Module):
    """The GDN output norm: weight * rmsnorm(o) * silu(z) (plain weight); the normalised o is
    rounded to o's dtype before the weight, the gate product taken in fp32, as transformers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o [..., Hv, V], normalised per head; z [..., Hv * V] (rows may be strided: a slice
        of the input projections' output) -> [..., Hv * V]."""
        V = o.shape[-1]
        if fused.available(o):
            return fused.rms_norm(o.flatten(-2), self.weight, self.eps, group_size=V, gate=z,
                                  gate_at="after")
        y = o.float()
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        return (self.weight * y * F.silu(z.unflatten(-1, (-1, V)).float())).to(o.dtype).flatten(-2)


class _MLP(nn.Module):
    """The SwiGLU MLP: a dense layer's (``intermediate_size``) or a sparse block's shared
    expert (``shared_expert_intermediate_size``), whose gate and up projections the block
    merges with its own (``merged=False``)."""

    def __init__(self, c: Qwen35Config, width: int | None = None, merged: bool = True) -> None:
        super().__init__()
        width = width or c.intermediate_size
        self.gate_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, c.hidden_size, bias=False)
        if merged:
            self._gate_up = MergedLinear(self.gate_proj, self.up_proj)

    @staticmethod
    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if fused.available(gate):
            return fused.silu_mul(gate, up)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(*self._gate_up(x)))


class _Experts(nn.Module):
    """The routed experts' weights, stacked as transformers holds them: ``gate_up_proj``
    [E, 2I, H] (each expert's gate rows, then its up rows), ``down_proj`` [E, H, I]."""

    def __init__(self, c: Qwen35MoeConfig) -> None:
        super().__init__()
        E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))


class _SparseMoe(nn.Module):
    """Qwen3.5-MoE's (and Qwen3-Next's) MLP: the router (``gate``) picks each token's top-k
    experts, whose outputs are summed with the router weights (renormalised where
    ``norm_topk_prob``: always in Qwen3.5-MoE), plus the shared expert scaled by
    sigmoid(``shared_expert_gate`` x).

    Routing as transformers rounds it: logits in the activations' dtype, softmax in fp32, top-k,
    the k weights divided by their sum (``norm_topk_prob``), then rounded to the activations'
    dtype. The experts run in :func:`replayssm.models.moe.routed_experts`, whose sum
    accumulates in the activations' dtype as transformers' does. Everything is device-side
    (topk, no host reads), so a decode step stays capturable. The router, the shared expert's
    gate and its gate and up projections all read x: one GEMM (a decode step's four
    projections in one launch)."""

    def __init__(self, c: Qwen35MoeConfig) -> None:
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.renormalise = c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = _Experts(c)
        self.shared_expert = _MLP(c, c.shared_expert_intermediate_size, merged=False)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)
        self._in_proj = MergedLinear(self.gate, self.shared_expert_gate,
                                     self.shared_expert.gate_proj, self.shared_expert.up_proj)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (expert ids [T, k], weights [T, k] in the logits' dtype)."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits, shared_gate, gate, up = self._in_proj(flat)
        ids, weights = self.route(logits)
        routed = routed_experts(flat, ids, weights, self.experts.gate_up_proj,
                                self.experts.down_proj, "swiglu")
        shared = self.shared_expert.down_proj(_MLP.activation(gate, up))
        return (routed + torch.sigmoid(shared_gate) * shared).view_as(x)


class _GatedDeltaNet(nn.Module):
    """The GDN mixer's weights (transformers' names) and the pieces around the recurrence."""

    def __init__(self, c: Qwen35Config) -> None:
        super().__init__()
        self.c = c
        Hv = c.linear_num_value_heads
        self._input_projections(c)
        # Depthwise: weight [conv_dim, 1, kernel], as nn.Conv1d(groups=conv_dim) stores it.
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.linear_conv_kernel_dim,
                                groups=c.conv_dim, bias=False,
                                padding=c.linear_conv_kernel_dim - 1)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))
        self.norm = _GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)

    def _input_projections(self, c: Qwen35Config) -> None:
        """The projections of x (Qwen3.5's four), merged into one GEMM (``_in_proj``)."""
        self.in_proj_qkv = nn.Linear(c.hidden_size, c.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, c.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self._in_proj = MergedLinear(self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                     self.in_proj_a)

    def project(self, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> the conv's input [..., conv_dim] (q, k, v channels), the output
        gate z [..., value_dim], b and a [..., num_v_heads]: column slices of one GEMM's
        output."""
        return self._in_proj(x)

    def gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta) in fp32 [..., num_v_heads] from the projections a and b: g = -exp(A_log)
        softplus(a + dt_bias) taken in fp32, beta = sigmoid(b) in the activations' dtype (as
        transformers rounds them)."""
        if fused.available(a):
            return fused.gdn_gates(a, b, self.A_log, self.dt_bias)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, torch.sigmoid(b).float()

    def splits(self) -> list[int]:
        return [self.c.key_dim, self.c.key_dim, self.c.value_dim]

    def split(self, mixed: "torch.Tensor | list[torch.Tensor]"
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs [..., conv_dim] (or split already) -> q, k [..., Hk, K], v [..., Hv, V]."""
        c = self.c
        q, k, v = mixed.split(self.splits(), dim=-1) if isinstance(mixed, torch.Tensor) else mixed
        lead = q.shape[:-1]
        return (q.reshape(*lead, c.linear_num_key_heads, c.linear_key_head_dim),
                k.reshape(*lead, c.linear_num_key_heads, c.linear_key_head_dim),
                v.reshape(*lead, c.linear_num_value_heads, c.linear_value_head_dim))

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o [..., Hv, V] (the recurrence's output) and the gate z [..., value_dim] -> the
        layer output."""
        return self.out_proj(self.norm(o, z))

    def _conv_args(self):
        return self.conv1d.weight[:, 0], None, "silu"

    def prefill(self, cache: ServingCache, layer: int, ctx: PrefillContext, x: torch.Tensor,
                rope: Any) -> torch.Tensor:
        """A prefill's x [n, hidden]: the chunked scan from the slot's state (zeros for a fresh
        slot), whose final state is loaded into the slot's SSM layer ``layer`` (``rope``: the
        mixers' shared signature; unused here)."""
        mixed, z, b, a = self.project(x)
        q, k, v = self.split(cache.conv_prefill(layer, ctx, mixed, *self._conv_args()))
        g, beta = self.gates(a, b)
        rep = self.c.linear_num_value_heads // self.c.linear_num_key_heads
        kept: list[torch.Tensor] = []
        o, state = gated_delta_chunked(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1),
                                       v, g, beta, cache.ssm_prefill_state(layer, ctx),
                                       ctx.chunk(_SCAN_CHUNK), ctx.block, kept)
        cache.ssm_prefill_end(layer, ctx, state, kept)
        return self.output(o.to(x.dtype), z)

    def decode(self, cache: ServingCache, layer: int, ctx: DecodeContext, x: torch.Tensor,
               rope: Any) -> torch.Tensor:
        """A window x [B, T, hidden] through gdn_decode (q and k normalised and q scaled by
        the op, as the prefill scan does)."""
        mixed, z, b, a = self.project(x)
        # Split by the conv itself: q, k and v come out contiguous (no copies for the op).
        q, k, v = self.split(cache.conv_decode(layer, ctx, mixed, *self._conv_args(),
                                               splits=self.splits()))
        g, beta = self.gates(a, b)
        batch, tokens = x.shape[:2]
        o = replayssm.gdn_decode(cache.ssm, layer, ctx.slot_ids, q, k, v, g.contiguous(),
                                 beta.contiguous(), scale=self.c.linear_key_head_dim ** -0.5,
                                 qk_l2norm=True, fold_every=cache.fold_every("gdn", batch, tokens))
        return self.output(o, z)


class _Attention(nn.Module):
    """Gated softmax attention's weights (transformers' names) and its projections."""

    def __init__(self, c: Qwen35Config) -> None:
        super().__init__()
        self.c = c
        hd, bias = c.head_dim, c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, c.hidden_size, bias=bias)
        self.q_norm = _RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = _RMSNorm(hd, c.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., hidden] -> q [..., H, hd], k, v [..., Hkv, hd] (normed, rotated) and the
        output gate [..., H * hd]; cos, sin [..., rotary_dim] broadcast over heads."""
        c = self.c
        lead = x.shape[:-1]
        # Per head: the query's head_dim values, then its gate's.
        q, gate = self.q_proj(x).view(*lead, c.num_attention_heads, 2 * c.head_dim).chunk(2, -1)
        q = _rotate(self.q_norm(q), cos, sin)
        k = _rotate(self.k_norm(self.k_proj(x).view(*lead, c.num_key_value_heads, c.head_dim)),
                    cos, sin)
        v = self.v_proj(x).view(*lead, c.num_key_value_heads, c.head_dim)
        return q, k, v, gate.reshape(*lead, -1)

    @staticmethod
    def output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [..., H, hd], gate [..., H * hd] -> o * sigmoid(gate) [..., H * hd]."""
        if fused.available(o):
            return fused.sigmoid_mul(gate, o.flatten(-2))
        return o.flatten(-2) * torch.sigmoid(gate)

    def output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [..., H, hd] -> the layer output, gated by sigmoid(gate)."""
        return self.o_proj(self.output_gate(o, gate))

    def prefill(self, cache: ServingCache, layer: int, ctx: PrefillContext, x: torch.Tensor,
                rope: Any) -> torch.Tensor:
        q, k, v, gate = self.qkv(x, *rope)
        k, v = cache.kv_prefill(layer, ctx, k, v)
        return self.output(causal_attention(q, k, v, self.c.head_dim ** -0.5), gate)

    def decode(self, cache: ServingCache, layer: int, ctx: DecodeContext, x: torch.Tensor,
               rope: Any) -> torch.Tensor:
        q, k, v, gate = self.qkv(x, *rope)
        cache.kv_decode(layer, ctx, k, v)
        return self.output(cache.attend(layer, ctx, q.contiguous(), self.c.head_dim ** -0.5),
                           gate)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on x's first rotary_dim dims (rotate-half pairing: dim i with
    i + rotary_dim / 2); cos, sin [..., rotary_dim] without the head axis."""
    if fused.available(x):
        return fused.rope(x, cos, sin)
    r = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xr, rest = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    rotated = xr * cos + torch.cat((-x2, x1), -1) * sin
    return torch.cat((rotated, rest), -1)


class _DecoderLayer(nn.Module):
    def __init__(self, c: Qwen35Config, index: int, gdn: type) -> None:
        super().__init__()
        self.kind = c.layer_types[index]
        if self.kind == LINEAR:
            self.linear_attn = gdn(c)
        else:
            self.self_attn = _Attention(c)
        self.mlp = _SparseMoe(c) if c.mlp_is_sparse(index) else _MLP(c)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.kind == LINEAR else self.self_attn


class _TextModel(nn.Module):
    def __init__(self, c: Qwen35Config, gdn: type) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(c, i, gdn) for i in range(c.num_hidden_layers))
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)


# ---- the model ---------------------------------------------------------------------------------

class Qwen35Model(HybridModel):
    """A Qwen3.5 text decoder (``Qwen3_5ForCausalLM``'s computation and weight names) served from
    a :class:`ServingCache`: GDN layers through the replayssm state cache, attention layers over
    its static KV cache."""

    config_class = Qwen35Config
    ignored_tensors = ("model.visual.", "mtp.")
    #: The GDN mixer class (Qwen3-Next's reads x through other projections).
    gdn_class: ClassVar[type] = _GatedDeltaNet

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.config = config
        self.model = _TextModel(config, self.gdn_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tie()
        # The SSM cache's layer index of each GDN layer, the KV cache's of each attention layer.
        self._cache_index = {i: n for n, i in enumerate(config.ssm_layers)}
        self._cache_index.update({i: n for n, i in enumerate(config.attention_layers)})

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def random(cls, config: Any, seed: int = 0, device: Any = "cpu",
               dtype: torch.dtype = torch.float32) -> "Qwen35Model":
        """Seeded random weights of ``config`` (a Qwen35Config or a config.json dict), drawn in
        fp32 on ``device`` and rounded to ``dtype``, scaled so activations stay O(1) through a
        small model (weights N(0, 1 / fan_in), embeddings N(0, 1)); the parameters
        transformers initialises to constants are drawn around them (norm weights, dt_bias) so
        that a test sees each one used; A uniform in [0.01, 16] as transformers draws it. A
        sparse block's router draws like any projection, so its logits are O(1) and tokens
        choose different experts."""
        config = cls._config(config)
        model = cls._empty(config, device, dtype)
        gen = torch.Generator(device=torch.device(device)).manual_seed(seed)

        def normal(shape, std):
            return torch.randn(shape, generator=gen, device=device) * std

        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("linear_attn.norm.weight"):      # a plain weight around 1
                values = 1.0 + normal(p.shape, 0.1)
            elif name.endswith("norm.weight"):                # 1 + weight: around 0
                values = normal(p.shape, 0.1)
            elif leaf == "dt_bias":
                values = 1.0 + normal(p.shape, 0.5)
            elif leaf == "A_log":
                u = torch.rand(p.shape, generator=gen, device=device)
                values = torch.log(0.01 + (16.0 - 0.01) * u)
            elif leaf == "bias":
                values = normal(p.shape, 0.02)
            elif name.endswith("conv1d.weight"):              # [C, 1, kernel]
                values = normal(p.shape, p.shape[-1] ** -0.5)
            elif name.endswith("embed_tokens.weight"):
                values = normal(p.shape, 1.0)
            else:                               # Linear [out, in]; experts [E, out, in]
                values = normal(p.shape, p.shape[-1] ** -0.5)
            p.copy_(values)
        return model

    @classmethod
    def _checkpoint_names(cls, names: list[str], tensors: dict[str, torch.Tensor]
                          ) -> dict[str, str]:
        """``Qwen3_5ForCausalLM``'s names (``model.*``, ``lm_head.weight``), or a published
        ``Qwen3_5ForConditionalGeneration``'s: the text tower under ``model.language_model.*``
        (its vision tower and multi-token-prediction head are skipped)."""
        tower = any(k.startswith(_TOWER_PREFIX) for k in tensors)
        return {k: (_TOWER_PREFIX + k[len("model."):] if tower and k.startswith("model.") else k)
                for k in names}

    def cache_layout(self) -> CacheLayout:
        c = self.config
        w = self.lm_head.weight
        return CacheLayout(
            ssm_kind="gdn", ssm_dims=c.gdn_dims, num_ssm_layers=len(c.ssm_layers),
            conv_channels=c.conv_dim, conv_kernel=c.linear_conv_kernel_dim,
            num_attn_layers=len(c.attention_layers), kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, device=w.device, dtype=w.dtype)

    # ---- shared pieces ----------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [..., rotary_dim] at integer positions, computed in fp32 and rounded to the
        activations' dtype (transformers rounds them there too). The inverse frequencies are
        made here rather than kept as a buffer, which ``model.to(bfloat16)`` would round."""
        r = self.config.rotary_dim
        exponent = torch.arange(0, r, 2, dtype=torch.float, device=positions.device) / r
        freqs = positions.float()[..., None] * (1.0 / (self.config.rope_theta ** exponent))
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _stack(self, tokens: torch.Tensor, positions: torch.Tensor, mix) -> torch.Tensor:
        h = self.model.embed_tokens(tokens)
        rope = self._rope(positions, h.dtype)  # the mixers' extra argument
        delta = None  # each update is added to h by the next norm (one fused launch)
        for i, layer in enumerate(self.model.layers):
            if delta is None:
                x = layer.input_layernorm(h)
            else:
                h, x = layer.input_layernorm.add(h, delta)
            delta = mix(layer.mixer, self._cache_index[i], x, rope)
            h, x = layer.post_attention_layernorm.add(h, delta)
            delta = layer.mlp(x)
        return self.lm_head(self.model.norm.add(h, delta)[1])


class Qwen35MoeModel(Qwen35Model):
    """A Qwen3.5-MoE text decoder (``Qwen3_5MoeForCausalLM``'s computation and weight names):
    :class:`Qwen35Model` with a sparse block (:class:`_SparseMoe`) as every layer's MLP.

    Checkpoints hold the routed experts either stacked (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I], as transformers holds them) or one expert at a time
    (``mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj``, ``down_proj`` [H, I]: what
    ``save_pretrained`` writes, undoing transformers' load-time merge); the latter are stacked
    here before the names and shapes are checked."""

    config_class = Qwen35MoeConfig

    @classmethod
    def from_tensors(cls, config: Any, tensors: dict[str, torch.Tensor], device: Any = "cpu",
                     dtype: torch.dtype = torch.float32) -> "Qwen35MoeModel":
        return super().from_tensors(config, _stack_experts(config, tensors, cls.ignored_tensors),
                                    device=device, dtype=dtype)


#: A per-expert checkpoint tensor: (the layer's ``...mlp.experts`` prefix, expert, projection).
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _stack_experts(c: Qwen35MoeConfig, tensors: dict[str, torch.Tensor],
                   ignored: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """``tensors`` with each layer's per-expert tensors replaced by the stacked pair
    (``gate_up_proj``: the experts' gate rows then their up rows; ``down_proj``). Refuses,
    by name, a missing or mis-shaped expert tensor (loader.stack_tensors), or a layer holding
    both forms; an expert past ``num_experts`` stays, for check_tensors to refuse as unknown.
    Names under an ``ignored`` prefix (the MTP head's own experts) pass through unstacked."""
    E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    prefixes = sorted({m.group(1) for m in map(_PER_EXPERT.match, tensors)
                       if m is not None and not m.string.startswith(ignored)})
    out = dict(tensors)
    for prefix in prefixes:
        for stacked in ("gate_up_proj", "down_proj"):
            if f"{prefix}.{stacked}" in tensors:
                raise ValueError(f"{prefix} holds both {prefix}.{stacked} and per-expert "
                                 f"tensors: one form only")
        names = {proj: [f"{prefix}.{e}.{proj}.weight" for e in range(E)] for proj in shapes}
        stack = {proj: stack_tensors(tensors, names[proj], shape) for proj, shape in shapes.items()}
        out[f"{prefix}.gate_up_proj"] = torch.cat((stack["gate_proj"], stack["up_proj"]), 1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
        for name in (n for group in names.values() for n in group):
            del out[name]
    return out
