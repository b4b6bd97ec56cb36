"""Qwen3.5-MoE (Qwen35MoeModel) against transformers' Qwen3_5MoeForCausalLM with the same
weights: the sparse block alone, whole runs (prefill, 64 cached steps), each state mode
against eager fp32 (routing pinned to eager fp32's choices; replay fp32's greedy tokens with
routing free), rows independent of their batch, routing that varies between tokens, the
loader on save_pretrained output (experts written one by one) and on the published layout
(stacked experts under model.language_model, an MTP head's experts skipped), the config
(transformers' names and defaults, refusals) and the 35B-A3B preset. Tiny configs; fp32 on
the CPU, bf16 (and fp32) on the GPU (marker ``cuda``).

transformers' experts run pinned to their own loop (``_experts_implementation = "eager"``:
one expert at a time, weighted and summed in the activations' dtype), which our grouped path
(replayssm.models.moe) computes with the same roundings in another summation order. Tolerances
are test_models_qwen's (same model, same stack, reasons there); the MoE rows measured below.
"""

import json

import pytest

torch = pytest.importorskip("torch")

from replayssm import models  # noqa: E402
from replayssm.models import StateMode  # noqa: E402
from replayssm.models import qwen3_5 as qw  # noqa: E402
from replayssm.models.loader import read_tensors  # noqa: E402

import models_util as mu  # noqa: E402
from models_util import one_cpu_thread  # noqa: E402,F401  (autouse)
from test_models_qwen import (  # noqa: E402
    MODE_TOL, check_bf16_error_within_twice_transformers,
    check_greedy_tokens_replay_fp32_equal_eager_fp32, check_matches_transformers_fp32, hf_twin,
    prompt, same_prefill, state_mode_runs, step_errors)

#: The sparse block alone against transformers' (same input, same weights): fp32 sums of a few
#: dozen terms in another order (measured 1.6e-7); bf16 rounds the products, the activation and
#: the weighted sum at the same places as transformers, in another order (measured 8.5e-3: about
#: two bf16 steps, 2^-8 = 3.9e-3, of the output's largest value).
BLOCK_TOL = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -6}


def tiny_moe(device="cpu", dtype=torch.float32, seed=3, **overrides):
    return qw.Qwen35MoeModel.random(qw.tiny_moe_config(**overrides), seed=seed, device=device,
                                    dtype=dtype)


def hf_block(block, config):
    """transformers' Qwen3_5MoeSparseMoeBlock with ``block``'s weights (its experts' loop)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

    d = config.to_hf()
    del d["model_type"], d["architectures"]
    hf_config = transformers.Qwen3_5MoeTextConfig(**d)
    hf_config._experts_implementation = "eager"
    w = block.gate.weight
    hf = hf_moe.Qwen3_5MoeSparseMoeBlock(hf_config)
    missing, unexpected = hf.load_state_dict({k: v.float().cpu()
                                              for k, v in block.state_dict().items()})
    assert not missing and not unexpected, (missing, unexpected)
    return hf.to(device=w.device, dtype=w.dtype).eval()


# ---- the sparse block -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_block_matches_transformers_block(dtype):
    """37 tokens through one layer's block: the routing (which experts, what weights) equals
    transformers' exactly, and the output agrees to the dtype's rounding."""
    model = tiny_moe(dtype=dtype, seed=1)
    block = model.model.layers[1].mlp
    hf = hf_block(block, model.config)
    x = torch.randn(1, 37, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    x = x.to(dtype)
    with torch.no_grad():
        _, weights_ref, ids_ref = hf.gate(x[0])
        ids, weights = block.route(block.gate(x[0]))
        assert torch.equal(ids, ids_ref) and torch.equal(weights, weights_ref)
        assert weights.dtype == dtype
        ref, got = hf(x), block(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert mu.rel_err(got, ref) < BLOCK_TOL[dtype]


def test_routing_varies_between_tokens_and_renormalises():
    """The random weights route: 40 normalised random inputs to every layer's block choose many
    different expert sets, every expert is chosen by some token, and each token's k weights
    are descending, positive and sum to 1."""
    model = tiny_moe(seed=4)
    c = model.config
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        block = layer.mlp
        with torch.no_grad():
            x = layer.post_attention_layernorm(torch.randn(40, c.hidden_size, generator=gen))
            ids, weights = block.route(block.gate(x))
        assert ids.shape == (40, c.num_experts_per_tok)
        assert len({tuple(sorted(row.tolist())) for row in ids}) >= 10
        assert set(ids.flatten().tolist()) == set(range(c.num_experts))
        assert bool((weights[:, :-1] >= weights[:, 1:]).all()) and bool((weights > 0).all())
        assert torch.allclose(weights.sum(-1), torch.ones(40))


# ---- against transformers ---------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_prefill_and_64_greedy_steps_match_transformers_fp32(tied):
    """Eager fp32 state, fp32 on the CPU: the prompt's logits (100 tokens: two chunks of the
    scan and a partial one), then 64 greedy steps with the same tokens chosen, each step's
    logits against transformers' cached decoding. Measured (untied) 8.4e-6 over the prompt,
    4.2e-6 over the steps."""
    check_matches_transformers_fp32(tiny_moe(seed=1, tie_word_embeddings=tied))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=mu.DEVICES[1].marks)])
def test_bf16_error_within_twice_transformers_own(device):
    """bf16 weights and activations: against transformers in fp32 (same weights, its greedy
    tokens fed to all three), our error stays within twice transformers' bf16 error, over the
    prompt and over 64 steps at worst and on average. A routing decision can flip between
    runs in bf16 (two experts' probabilities within a rounding), in theirs as in ours: the
    bound is on the whole run's error, which such a flip moves in both (measured on the CPU:
    prompt 0.22 ours, 0.57 theirs; steps at worst 0.60 and 0.50, on average 0.077 and 0.076)."""
    check_bf16_error_within_twice_transformers(tiny_moe(device, torch.bfloat16, seed=2),
                                               tiny_moe(device, seed=2))


# ---- state modes, batches, capture ------------------------------------------------------------

def routing(model, record=None, replay=None, disagreeing=None):
    """mu.pinned_routing over ``model``'s sparse blocks (one layer per block; a dense MLP
    layer has none): their route method, replayed ids weighted by :func:`top_k_weights`."""
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, qw._SparseMoe)]
    return mu.pinned_routing(blocks, top_k_weights, record, replay, disagreeing, method="route")


def top_k_weights(block, logits, ids):
    """The weights ``block.route`` gives experts ``ids`` for router ``logits``: their softmax
    probabilities (fp32), divided by their sum where the block renormalises, in the logits'
    dtype."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    if block.renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype)


@pytest.mark.parametrize("where", mu.DEVICES_FP32)
@pytest.mark.parametrize("mode", [m for m in StateMode.NAMES if m != "eager-fp32"] +
                         ["replay-fp32:4", "replay-fp32+bf16:4"])
def test_state_modes_match_eager_fp32(where, mode):
    """70 teacher-forced steps after a 21-token prompt (4 folds at L = 16, 17 at L = 4), each
    token's experts pinned to those it chose in the eager fp32 run (:func:`routing`), every
    step within MODE_TOL. Pinned, because a lossy state moves a router's logits by its
    rounding, which can flip a near-tied choice and move that step's logits by O(1) (free,
    with fp8 checkpoints: one token's choice in one layer flips at step 65, which errs by 0.12
    and the three after it by ~0.05, where pinned they err by at most 2.3e-2); pinned, the
    comparison measures the state's precision, and a wrong state still errs by O(1) at every
    step. Measured (CPU, fp32 activations), per step at most: eager-bf16 3.1e-3, replay-fp32
    3.9e-6 (8.7e-6 at L = 4), bf16 state or checkpoints 1.6e-3 (1.9e-3 at L = 4), fp8
    checkpoints 2.3e-2."""
    device, dtype = where
    errors = step_errors(*state_mode_runs(tiny_moe(device, dtype), mode, routing))
    tol = MODE_TOL[mode.split(":")[0]]
    worst = int(errors.argmax())
    assert errors[worst] < tol, f"worst step {worst}: {errors[worst]:.3g} >= {tol}"


@pytest.mark.parametrize("where", mu.DEVICES_FP32)
def test_greedy_tokens_replay_fp32_equal_eager_fp32_over_256_steps_with_free_routing(where):
    """test_models_qwen's check with the routers free: an fp32 state's error (5.7e-6 over the
    run, measured) is far from flipping a choice, so the same tokens come out."""
    device, dtype = where
    check_greedy_tokens_replay_fp32_equal_eager_fp32(tiny_moe(device, dtype))


@pytest.mark.parametrize("where", mu.DEVICES)
def test_a_rows_logits_do_not_depend_on_the_other_rows(where):
    """Row 0 beside other sequences, pad rows and a late joiner (mu.check_rows_independent):
    the same logits up to rounding, not bit for bit as the dense family's. The routed
    experts' grouped product rounds a row's sums according to the other rows sharing its
    experts (PyTorch's CPU grouped_mm: 1e-4 absolute on outputs of ~10 for one token alone
    against the same token among nine), which the layers above carry on; measured 5.8e-7 on
    the CPU. Another row's token in row 0's place would err by O(1)."""
    device, dtype = where
    mu.check_rows_independent(
        tiny_moe(device, dtype), [prompt(n, seed=8 + n, device=device) for n in (9, 14, 3, 17)],
        device, tol=mu.mode_tolerance("replay-fp32", dtype))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_step_equals_eager_steps():
    """model.step captured in a CUDA graph (bf16: the routed experts' grouped product, no host
    read in the routing), replayed against eager steps: identical logits across folds."""
    model = tiny_moe("cuda", torch.bfloat16)
    mu.check_captured_step(model, [prompt(n, seed=n, device="cuda") for n in (21, 5, 13)])


# ---- loading ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_pretrained_sharded_loads_and_matches(tmp_path, tied):
    """transformers writes the experts one by one (mlp.experts.{e}.gate_proj.weight, ...), in
    shards; models.load picks Qwen35MoeModel by model_type and stacks them back: every tensor
    equal, the same prefill logits."""
    model = tiny_moe(seed=4, tie_word_embeddings=tied)
    hf_twin(model).save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in index["weight_map"]
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    loaded = models.load(tmp_path)
    assert type(loaded) is qw.Qwen35MoeModel
    assert loaded.config == model.config
    ours = model.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, ours[name]), name
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert same_prefill(model, loaded, prompt(11))


def test_published_checkpoint_layout_loads(tmp_path):
    """model_type qwen3_5_moe with the text tower in text_config, weights under
    model.language_model.* with the experts stacked, and a vision tower and an MTP head (with
    its own per-expert tensors) that a text decoder skips."""
    save_file = pytest.importorskip("safetensors.torch").save_file

    model = tiny_moe(seed=5)
    text = model.config.to_hf()
    del text["tie_word_embeddings"], text["architectures"]
    config = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "tie_word_embeddings": False, "text_config": text, "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {k.replace("model.", "model.language_model.", 1): v.clone()
               for k, v in model.state_dict().items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 3)
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = models.load(tmp_path)
    assert type(loaded) is qw.Qwen35MoeModel
    assert loaded.config == model.config
    assert same_prefill(model, loaded, prompt(11))


def test_loader_refuses_missing_misshaped_surplus_and_doubled_experts_by_name(tmp_path):
    model = tiny_moe()
    hf_twin(model).save_pretrained(tmp_path)
    tensors = read_tensors(tmp_path)
    expert = "model.layers.2.mlp.experts.5.down_proj.weight"
    router = "model.layers.2.mlp.gate.weight"
    stacked = "model.layers.2.mlp.experts.gate_up_proj"
    cases = [
        ({k: v for k, v in tensors.items() if k != expert}, f"missing tensor {expert}"),
        ({**tensors, expert: torch.zeros(48, 23)},
         f"tensor {expert} has shape \\(48, 23\\), expected \\(48, 24\\)"),
        ({**tensors, "model.layers.2.mlp.experts.8.up_proj.weight": torch.zeros(24, 48)},
         "unexpected tensor model.layers.2.mlp.experts.8.up_proj.weight"),
        ({**tensors, stacked: torch.zeros(8, 48, 48)}, "both .*gate_up_proj and per-expert"),
        ({k: v for k, v in tensors.items() if k != router}, f"missing tensor {router}"),
        ({**tensors, router: torch.zeros(7, 48)}, f"tensor {router} has shape \\(7, 48\\)"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            qw.Qwen35MoeModel.from_tensors(model.config, bad)
    # Stacked and stacked again is refused by check_tensors: the stacked names are checked.
    state = {k: v for k, v in model.state_dict().items()}
    state["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 48, 25)
    with pytest.raises(ValueError, match="tensor model.layers.0.mlp.experts.down_proj has shape"):
        qw.Qwen35MoeModel.from_tensors(model.config, state)


def test_models_load_picks_the_family_by_model_type():
    cfg = qw.tiny_moe_config()
    assert type(models.load(cfg)) is qw.Qwen35MoeModel
    assert type(models.load(cfg.to_hf())) is qw.Qwen35MoeModel
    assert type(models.load({"model_type": "qwen3_5_moe", "text_config": cfg.to_hf()})) is (
        qw.Qwen35MoeModel)
    assert type(models.load(qw.tiny_config())) is qw.Qwen35Model
    assert isinstance(models.load(cfg).model.layers[0].mlp, qw._SparseMoe)


# ---- config -----------------------------------------------------------------------------------

def test_config_round_trips_takes_transformers_defaults_and_refuses_bad_values():
    transformers = pytest.importorskip("transformers")
    cfg = qw.tiny_moe_config()
    assert qw.Qwen35MoeConfig.from_hf(cfg.to_hf()) == cfg
    assert qw.Qwen35MoeConfig.from_hf(json.loads(cfg.to_json())) == cfg
    assert "intermediate_size" not in cfg.to_hf()
    # A config.json that leaves the MoE fields out gets transformers' defaults.
    d = cfg.to_hf()
    moe_fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size")
    for f in moe_fields:
        del d[f]
    theirs = transformers.Qwen3_5MoeTextConfig()
    assert all(getattr(qw.Qwen35MoeConfig.from_hf(d), f) == getattr(theirs, f)
               for f in moe_fields)
    # A MoE config.json is not a dense layout, nor the reverse.
    with pytest.raises(ValueError, match="model_type 'qwen3_5_moe_text' is not a Qwen35Config"):
        qw.Qwen35Config.from_hf(cfg.to_hf())
    with pytest.raises(ValueError, match="model_type 'qwen3_5' is not a Qwen35MoeConfig"):
        qw.Qwen35MoeConfig.from_hf({"model_type": "qwen3_5", "text_config": cfg.to_hf()})
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be in \\[1, num_experts"):
        qw.tiny_moe_config(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts 0"):
        qw.tiny_moe_config(num_experts=0, num_experts_per_tok=0)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size 0 must be positive"):
        qw.tiny_moe_config(shared_expert_intermediate_size=0)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        qw.Qwen35MoeConfig.from_hf({**cfg.to_hf(), "norm_topk_prob": False})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        qw.Qwen35MoeConfig.from_hf({**cfg.to_hf(), "mlp_only_layers": [0]})
    # The dense family's rules hold here too (one place for them).
    with pytest.raises(ValueError, match="layer_types has 2 entries for 6 layers"):
        qw.tiny_moe_config(layer_types=("linear_attention", "full_attention"))


def test_35b_a3b_layout_builds_in_transformers_with_our_weight_shapes():
    """The 35B-A3B preset is a valid transformers config, and its Qwen3_5MoeForCausalLM (on the
    meta device) has exactly our parameter names and shapes; its GDN layers are the 4B's
    shape (the layer benchmark's qwen35-4b)."""
    transformers = pytest.importorskip("transformers")
    cfg = qw.QWEN35_MOE_35B_A3B
    assert (len(cfg.ssm_layers), len(cfg.attention_layers)) == (30, 10)
    assert cfg.attention_layers == list(range(3, 40, 4))
    assert cfg.gdn_dims == qw.QWEN35_4B.gdn_dims
    d = cfg.to_hf()
    del d["model_type"], d["architectures"]
    with torch.device("meta"):
        hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**d))
        ours = qw.Qwen35MoeModel(cfg)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert theirs == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    # About 35B parameters, 3B of them active per token (8 of 256 experts).
    total = sum(v.numel() for v in ours.state_dict().values())
    experts = sum(v.numel() for k, v in ours.state_dict().items() if ".experts." in k)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    assert 34e9 < total < 36e9 and 2.5e9 < active < 3.5e9, (total, active)
