"""Qwen3-Next (Qwen3NextModel) against transformers' Qwen3NextForCausalLM with the same weights:
the sparse block alone (renormalised top-k or not), whole runs (prefill, 64 cached steps) with
sparse blocks everywhere, with dense MLP layers (mlp_only_layers, decoder_sparse_step) and
without renormalisation, each state mode against eager fp32 (routing pinned, and free for
replay fp32's greedy tokens), rows independent of their batch, the fused GDN projections'
layout (held de-interleaved, seen in transformers' order), the loader on save_pretrained
output, the config (transformers' names and defaults, refusals) and the 80B-A3B preset. Tiny
configs; fp32 on the CPU, bf16 (and fp32) on the GPU (marker ``cuda``).

transformers' experts run pinned to their own loop (``_experts_implementation = "eager"``),
as in test_models_qwen_moe. Tolerances are test_models_qwen's and test_models_qwen_moe's (the
same layers and sparse block; reasons there), measured values for this family below.
"""

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")

from replayssm import models  # noqa: E402
from replayssm.models import StateMode  # noqa: E402
from replayssm.models import qwen3_5 as qw  # noqa: E402
from replayssm.models import qwen3_next as qn  # noqa: E402
from replayssm.models.loader import read_tensors  # noqa: E402

import models_util as mu  # noqa: E402
from models_util import one_cpu_thread  # noqa: E402,F401  (autouse)
from test_models_qwen import (  # noqa: E402
    MODE_TOL, check_bf16_error_within_twice_transformers,
    check_greedy_tokens_replay_fp32_equal_eager_fp32, check_matches_transformers_fp32, our_run,
    prompt, same_prefill, state_mode_runs, step_errors, with_our_weights)
from test_models_qwen_moe import BLOCK_TOL, routing  # noqa: E402

#: Layouts compared with transformers: sparse blocks everywhere (the 80B's), dense MLPs in
#: layers 0, 2, 3, 4 (decoder_sparse_step 2 makes the even layers dense, mlp_only_layers adds
#: layer 3: a GDN layer and an attention layer of each kind), the top-k weights not
#: renormalised.
LAYOUTS = {
    "sparse": {},
    "dense-layers": dict(decoder_sparse_step=2, mlp_only_layers=(3,)),
    "no-renormalise": dict(norm_topk_prob=False),
}


def tiny_next(device="cpu", dtype=torch.float32, seed=3, **overrides):
    return qn.Qwen3NextModel.random(qn.tiny_next_config(**overrides), seed=seed, device=device,
                                    dtype=dtype)


def hf_config(config):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip("this transformers has no Qwen3NextForCausalLM")
    d = config.to_hf()
    del d["model_type"], d["architectures"]
    hf = transformers.Qwen3NextConfig(**d)
    # The experts class's own loop, not whichever kernel the installed PyTorch lets
    # transformers pick (as test_models_qwen's hf_twin).
    hf._experts_implementation = "eager"
    return hf


def hf_twin(model):
    """transformers' Qwen3NextForCausalLM with ``model``'s weights (its state_dict: the fused
    projections in transformers' order), device and dtype."""
    transformers = pytest.importorskip("transformers")
    return with_our_weights(transformers.Qwen3NextForCausalLM(hf_config(model.config)), model)


def hf_block(block, config):
    """transformers' Qwen3NextSparseMoeBlock with ``block``'s weights."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

    hf = hf_next.Qwen3NextSparseMoeBlock(hf_config(config))
    missing, unexpected = hf.load_state_dict({k: v.float().cpu()
                                              for k, v in block.state_dict().items()})
    assert not missing and not unexpected, (missing, unexpected)
    w = block.gate.weight
    return hf.to(device=w.device, dtype=w.dtype).eval()


# ---- the sparse block -------------------------------------------------------------------------

@pytest.mark.parametrize("renormalise", [True, False], ids=["norm-topk", "no-norm-topk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_block_matches_transformers_block(dtype, renormalise):
    """37 tokens through one layer's block: the routing (which experts, what weights) equals
    transformers' exactly, renormalised or not, and the output agrees to the dtype's
    rounding (test_models_qwen_moe's BLOCK_TOL)."""
    model = tiny_next(dtype=dtype, seed=1, norm_topk_prob=renormalise)
    block = model.model.layers[1].mlp
    hf = hf_block(block, model.config)
    x = torch.randn(1, 37, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    x = x.to(dtype)
    with torch.no_grad():
        _, weights_ref, ids_ref = hf.gate(x[0])
        ids, weights = block.route(block.gate(x[0]))
        assert torch.equal(ids, ids_ref) and torch.equal(weights, weights_ref)
        ref, got = hf(x), block(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert mu.rel_err(got, ref) < BLOCK_TOL[dtype]


@pytest.mark.parametrize("renormalise", [True, False], ids=["norm-topk", "no-norm-topk"])
def test_routing_varies_between_tokens(renormalise):
    """The random weights route: 40 normalised random inputs choose many different expert
    sets and every expert; the k weights are descending and positive, summing to 1 when
    renormalised and to less than 1 (the chosen experts' softmax mass) when not."""
    model = tiny_next(seed=4, norm_topk_prob=renormalise)
    c = model.config
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        block = layer.mlp
        with torch.no_grad():
            x = layer.post_attention_layernorm(torch.randn(40, c.hidden_size, generator=gen))
            ids, weights = block.route(block.gate(x))
        assert len({tuple(sorted(row.tolist())) for row in ids}) >= 10
        assert set(ids.flatten().tolist()) == set(range(c.num_experts))
        assert bool((weights[:, :-1] >= weights[:, 1:]).all()) and bool((weights > 0).all())
        sums = weights.sum(-1)
        if renormalise:
            assert torch.allclose(sums, torch.ones(40))
        else:
            assert bool((sums < 0.99).all())


def test_dense_layers_where_transformers_puts_them():
    """mlp_only_layers and decoder_sparse_step pick the same layers as transformers'."""
    transformers = pytest.importorskip("transformers")
    expected = {"sparse": [True] * 6, "no-renormalise": [True] * 6,
                "dense-layers": [False, True, False, False, False, True]}
    for layout, overrides in LAYOUTS.items():
        model = tiny_next(**overrides)
        hf = transformers.Qwen3NextForCausalLM(hf_config(model.config))
        theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
        ours = [isinstance(layer.mlp, qw._SparseMoe) for layer in model.model.layers]
        assert ours == theirs == expected[layout], layout
        assert [model.config.mlp_is_sparse(i) for i in range(6)] == ours


# ---- the fused GDN projections ----------------------------------------------------------------

def test_fused_projections_are_held_de_interleaved_and_seen_in_transformers_order():
    """The GDN parameters hold Qwen3.5's row order (one GEMM: conv input, z, b, a as column
    slices); state_dict gives transformers' per-key-head order, load_state_dict takes it
    back. transformers fed our parameters as they are held errs by O(1): the order matters
    (key heads of q/k width 16, value groups 2 x 8: no two parts of one width)."""
    model = tiny_next(seed=6)
    c = model.config
    gdn = model.model.layers[0].linear_attn
    state = model.state_dict()
    held = gdn.in_proj_qkvz.weight
    saved = state["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    K, V, r = c.linear_key_head_dim, c.linear_value_head_dim, 2
    group = 2 * K + 2 * r * V
    # Key head 1's q rows in transformers' order are our rows K .. 2K (q of key head 1).
    assert torch.equal(saved[group:group + K], held[K:2 * K])
    # Its z rows: our z block starts after q, k and v of every head.
    z1 = c.conv_dim + r * V
    assert torch.equal(saved[group + 2 * K + r * V:2 * group], held[z1:z1 + r * V])
    ba = state["model.layers.0.linear_attn.in_proj_ba.weight"]
    Hv = c.linear_num_value_heads
    assert torch.equal(ba[:r], gdn.in_proj_ba.weight[:r])            # b of key head 0
    assert torch.equal(ba[r:2 * r], gdn.in_proj_ba.weight[Hv:Hv + r])  # a of key head 0
    # load_state_dict takes transformers' order back.
    copy = qn.Qwen3NextModel.random(c, seed=7)
    copy.load_state_dict(state)
    assert torch.equal(copy.model.layers[0].linear_attn.in_proj_qkvz.weight, held)
    # The comparison with transformers sees the order.
    tokens = prompt(20)
    hf = hf_twin(model)
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
        for i in c.ssm_layers:
            ours = model.model.layers[i].linear_attn
            hf.model.layers[i].linear_attn.in_proj_qkvz.weight.copy_(ours.in_proj_qkvz.weight)
            hf.model.layers[i].linear_attn.in_proj_ba.weight.copy_(ours.in_proj_ba.weight)
        wrong = hf(tokens[None]).logits[0]
    assert mu.rel_err(wrong, ref) > 0.1


def test_the_mixers_are_qwen35s_over_the_same_rows():
    """A Qwen3-Next model holding a Qwen3.5-MoE model's weights (its four GDN projections as
    the fused ones' de-interleaved rows: [qkv; z] and [b; a]) gives the same logits bit for
    bit, prefill and steps: the same GEMM, mixers, state and cache calls."""
    moe = qw.Qwen35MoeModel.random(qw.tiny_moe_config(), seed=8)
    nxt = qn.Qwen3NextModel.random(qn.tiny_next_config(), seed=9)
    with torch.no_grad():
        params = dict(nxt.named_parameters())
        for name, p in moe.named_parameters():
            if ".in_proj_" not in name:
                params[name].copy_(p)
        for i in moe.config.ssm_layers:
            a, b = moe.model.layers[i].linear_attn, nxt.model.layers[i].linear_attn
            b.in_proj_qkvz.weight.copy_(torch.cat([a.in_proj_qkv.weight, a.in_proj_z.weight]))
            b.in_proj_ba.weight.copy_(torch.cat([a.in_proj_b.weight, a.in_proj_a.weight]))
    tokens, stream = prompt(21, seed=2), prompt(8, seed=3).tolist()
    first_moe, steps_moe, _ = our_run(moe, "replay-fp32:4", tokens, 8, forced=stream)
    first, steps, _ = our_run(nxt, "replay-fp32:4", tokens, 8, forced=stream)
    assert torch.equal(first, first_moe) and torch.equal(torch.stack(steps), torch.stack(steps_moe))


# ---- against transformers ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS) + ["tied"])
def test_prefill_and_64_greedy_steps_match_transformers_fp32(layout):
    """Eager fp32 state, fp32 on the CPU: the prompt's logits (100 tokens: two chunks of the
    scan and a partial one), then 64 greedy steps with the same tokens chosen, each step's
    logits against transformers' cached decoding. Measured (CPU; FP32_TOL: test_models_qwen's):
    prompt 8.4e-6, 1.5e-5, 4.5e-6, 3.0e-6 and steps 4.2e-6, 4.5e-6, 4.5e-6, 5.3e-7 (sparse,
    dense-layers, no-renormalise, tied)."""
    overrides = dict(tie_word_embeddings=True) if layout == "tied" else LAYOUTS[layout]
    check_matches_transformers_fp32(tiny_next(seed=1, **overrides), hf_twin)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=mu.DEVICES[1].marks)])
def test_bf16_error_within_twice_transformers_own(device):
    """bf16 weights and activations: against transformers in fp32 (same weights, its greedy
    tokens fed to all three), our error stays within twice transformers' bf16 error, over the
    prompt and over 64 steps at worst and on average, on the dense-layers layout (the sparse
    one's weights are test_models_qwen_moe's model's, which that test covers). Measured on the
    CPU: prompt 0.12 ours, 0.13 theirs; steps at worst 0.17 and 0.15, on average 0.045 and
    0.035. A routing decision can flip between runs in bf16 (two experts' probabilities
    within a rounding), in theirs as in ours; a flip in one run and not the other moves the
    comparison: at seed 2, layer 1's experts 6 and 7 tie at 0.1192 in our bf16 run at the
    first step (transformers: 0.1202 and 0.1174) and that step errs by 0.11 against 0.007,
    0.29 at worst against 0.12, though the same step's routing in fp32 matches."""
    layout = LAYOUTS["dense-layers"]
    check_bf16_error_within_twice_transformers(
        tiny_next(device, torch.bfloat16, seed=3, **layout), tiny_next(device, seed=3, **layout),
        hf_twin)


# ---- state modes, batches, capture ------------------------------------------------------------

@pytest.mark.parametrize("where", mu.DEVICES_FP32)
@pytest.mark.parametrize("mode", [m for m in StateMode.NAMES if m != "eager-fp32"] +
                         ["replay-fp32:4", "replay-fp32+bf16:4"])
def test_state_modes_match_eager_fp32(where, mode):
    """70 teacher-forced steps after a 21-token prompt (4 folds at L = 16, 17 at L = 4), on
    the dense-layers layout (sparse and dense MLPs both downstream of the state), each
    token's experts pinned to those it chose in the eager fp32 run (test_models_qwen_moe's
    routing, and its reason), every step within MODE_TOL. Measured (CPU, fp32 activations),
    per step at most: eager-bf16 2.8e-3 (free, one token's choice flips: 0.06), replay-fp32
    4.6e-6, bf16 state or checkpoints 1.8e-3 (1.9e-3 at L = 4), fp8 checkpoints 3.1e-2."""
    device, dtype = where
    model = tiny_next(device, dtype, **LAYOUTS["dense-layers"])
    errors = step_errors(*state_mode_runs(model, mode, routing))
    tol = MODE_TOL[mode.split(":")[0]]
    worst = int(errors.argmax())
    assert errors[worst] < tol, f"worst step {worst}: {errors[worst]:.3g} >= {tol}"


@pytest.mark.parametrize("where", mu.DEVICES_FP32)
def test_greedy_tokens_replay_fp32_equal_eager_fp32_over_256_steps_with_free_routing(where):
    """test_models_qwen's check with the routers free, on the dense-layers layout (measured
    1.3e-5 over the run)."""
    device, dtype = where
    check_greedy_tokens_replay_fp32_equal_eager_fp32(
        tiny_next(device, dtype, **LAYOUTS["dense-layers"]))


@pytest.mark.parametrize("where", mu.DEVICES)
def test_a_rows_logits_do_not_depend_on_the_other_rows(where):
    """Row 0 beside other sequences, pad rows and a late joiner (mu.check_rows_independent):
    the same logits up to the grouped product's rounding (test_models_qwen_moe's reason)."""
    device, dtype = where
    mu.check_rows_independent(
        tiny_next(device, dtype), [prompt(n, seed=8 + n, device=device) for n in (9, 14, 3, 17)],
        device, tol=mu.mode_tolerance("replay-fp32", dtype))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_step_equals_eager_steps():
    """model.step captured in a CUDA graph (bf16: the fused projections' column slices, the
    routed experts' grouped product, a dense layer), replayed against eager steps."""
    model = tiny_next("cuda", torch.bfloat16, **LAYOUTS["dense-layers"])
    mu.check_captured_step(model, [prompt(n, seed=n, device="cuda") for n in (21, 5, 13)])


# ---- loading ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_pretrained_sharded_loads_and_matches(tmp_path, tied):
    """transformers writes the experts one by one and the fused projections in its order, in
    shards; models.load picks Qwen3NextModel by model_type, stacks the experts and
    de-interleaves the projections: every tensor equal, the same prefill logits."""
    model = tiny_next(seed=4, tie_word_embeddings=tied, **LAYOUTS["dense-layers"])
    hf_twin(model).save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in index["weight_map"]
    assert "model.layers.0.mlp.up_proj.weight" in index["weight_map"]   # a dense layer
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_next"
    loaded = models.load(tmp_path)
    assert type(loaded) is qn.Qwen3NextModel
    assert loaded.config == model.config
    ours = dict(model.named_parameters())
    for name, t in loaded.named_parameters():
        assert torch.equal(t, ours[name]), name
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert same_prefill(model, loaded, prompt(11))


def test_published_layout_loads_skipping_the_mtp_head(tmp_path):
    """A config.json as the hub's (rope_theta and partial_rotary_factor at the top level,
    rope_scaling null, full_attention_interval without layer_types), stacked experts, an MTP
    head's tensors (skipped)."""
    save_file = pytest.importorskip("safetensors.torch").save_file

    model = tiny_next(seed=5, layer_types=(), full_attention_interval=3)
    config = model.config.to_hf()
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    config.update(rope_theta=rope["rope_theta"], rope_scaling=None, full_attention_interval=3,
                  partial_rotary_factor=rope["partial_rotary_factor"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(2, 2)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = models.load(tmp_path)
    assert loaded.config == model.config
    assert loaded.config.attention_layers == [2, 5]
    assert same_prefill(model, loaded, prompt(11))


def test_loader_refuses_misshaped_and_missing_fused_projections_by_name(tmp_path):
    model = tiny_next()
    hf_twin(model).save_pretrained(tmp_path)
    tensors = read_tensors(tmp_path)
    qkvz = "model.layers.3.linear_attn.in_proj_qkvz.weight"
    ba = "model.layers.3.linear_attn.in_proj_ba.weight"
    cases = [
        ({k: v for k, v in tensors.items() if k != qkvz}, f"missing tensor {qkvz}"),
        ({**tensors, qkvz: torch.zeros(127, 48)}, f"tensor {qkvz} has shape \\(127, 48\\), "
                                                 f"expected \\(128, 48\\)"),
        ({**tensors, ba: torch.zeros(4, 48)}, f"tensor {ba} has shape \\(4, 48\\)"),
        ({**tensors, "model.layers.3.linear_attn.in_proj_qkv.weight": torch.zeros(64, 48)},
         "unexpected tensor"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            qn.Qwen3NextModel.from_tensors(model.config, bad)


def test_models_load_picks_the_family_by_model_type():
    cfg = qn.tiny_next_config()
    assert type(models.load(cfg)) is qn.Qwen3NextModel
    assert type(models.load(cfg.to_hf())) is qn.Qwen3NextModel
    assert models.family("qwen3_next") is qn.Qwen3NextModel
    assert type(models.load(qw.tiny_moe_config())) is qw.Qwen35MoeModel


# ---- config -----------------------------------------------------------------------------------

def test_config_round_trips_takes_transformers_defaults_and_refuses_bad_values():
    transformers = pytest.importorskip("transformers")
    cfg = qn.tiny_next_config(**LAYOUTS["dense-layers"], norm_topk_prob=False)
    assert qn.Qwen3NextConfig.from_hf(cfg.to_hf()) == cfg
    assert qn.Qwen3NextConfig.from_hf(json.loads(cfg.to_json())) == cfg
    assert "mrope_section" not in cfg.to_hf()["rope_parameters"]
    # A config.json with nothing but its model_type gets transformers' defaults.
    ours = qn.Qwen3NextConfig.from_hf({"model_type": "qwen3_next"})
    theirs = transformers.Qwen3NextConfig()
    rope = theirs.rope_parameters
    for f in (field.name for field in dataclasses.fields(qn.Qwen3NextConfig)):
        if f == "full_attention_interval":
            continue  # transformers keeps only the layer_types it makes of it
        expected = rope[f] if f in ("rope_theta", "partial_rotary_factor") else getattr(theirs, f)
        got = getattr(ours, f)
        assert (list(got) if isinstance(got, tuple) else got) == expected, f
    assert ours == qn.Qwen3NextConfig()
    # Refusals, by name.
    with pytest.raises(ValueError, match="decoder_sparse_step 0 must be >= 1"):
        qn.tiny_next_config(decoder_sparse_step=0)
    with pytest.raises(ValueError, match="mlp_only_layers \\[6\\] are not layers of 6"):
        qn.tiny_next_config(mlp_only_layers=(6,))
    with pytest.raises(ValueError, match="intermediate_size 0 must be positive: layers \\[3\\]"):
        qn.tiny_next_config(mlp_only_layers=(3,), intermediate_size=0)
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be in"):
        qn.tiny_next_config(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        qn.Qwen3NextConfig.from_hf({**cfg.to_hf(), "rope_parameters": None,
                                    "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type 'qwen3_5_moe_text' is not a Qwen3NextConfig"):
        qn.Qwen3NextConfig.from_hf(qw.tiny_moe_config().to_hf())
    with pytest.raises(ValueError, match="model_type 'qwen3_next' is not a Qwen35MoeConfig"):
        qw.Qwen35MoeConfig.from_hf(cfg.to_hf())
    # No experts at all: every layer dense (transformers' rule), the MoE fields unused.
    dense = qn.tiny_next_config(num_experts=0)
    assert not any(dense.mlp_is_sparse(i) for i in range(6))
    assert not any(isinstance(layer.mlp, qw._SparseMoe)
                   for layer in qn.Qwen3NextModel(dense).model.layers)


def test_80b_a3b_layout_builds_in_transformers_with_our_weight_shapes():
    """The 80B-A3B preset is a valid transformers config, and its Qwen3NextForCausalLM (on the
    meta device) has exactly our parameter names and shapes; its GDN layers are Qwen3.5-4B's
    shape (the layer benchmark's qwen35-4b); about 80B parameters, 3B active per token."""
    transformers = pytest.importorskip("transformers")
    cfg = qn.QWEN3_NEXT_80B_A3B
    assert (len(cfg.ssm_layers), len(cfg.attention_layers)) == (36, 12)
    assert cfg.attention_layers == list(range(3, 48, 4))
    assert cfg.gdn_dims == qw.QWEN35_4B.gdn_dims
    assert cfg.rotary_dim == 64
    with torch.device("meta"):
        hf = transformers.Qwen3NextForCausalLM(hf_config(cfg))
        ours = qn.Qwen3NextModel(cfg)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert theirs == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    total = sum(v.numel() for v in ours.state_dict().values())
    experts = sum(v.numel() for k, v in ours.state_dict().items() if ".experts." in k)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    assert 79e9 < total < 82e9 and 2.5e9 < active < 4e9, (total, active)
