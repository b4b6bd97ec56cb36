"""Nemotron-H's mixture-of-experts layers ('E') against transformers' NemotronHForCausalLM (same
weights), with and without the latent projections: the whole model (prefill and decode), every
state mode against eager fp32, speculative windows, batches, the router alone against
hand-computed choices and transformers' router, the loader on save_pretrained output (one
tensor per expert) and on stacked experts, the config's fields and refusals, and the 30B-A3B
preset's shapes. The checks are test_models_nemotron.py's, run on MoE layouts; tolerances as
there (the experts add fp32 sums of the same kind as the MLPs').
"""

import contextlib
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from replayssm import models  # noqa: E402
from replayssm.models import ServingCache  # noqa: E402
from replayssm.models.loader import read_tensors  # noqa: E402
from replayssm.models.nemotron_h import NemotronHConfig, NemotronHModel  # noqa: E402

import models_util as mu  # noqa: E402
from models_util import one_cpu_thread  # noqa: E402,F401  (autouse)
from test_models_nemotron import (  # noqa: E402
    check_matches_transformers, check_save_pretrained_round_trip, check_state_mode,
    check_window_then_commit, hf_twin, prompts, run_teacher_forced)

# Overrides of NemotronHConfig.tiny_moe per variant.
VARIANTS = [pytest.param({}, id="moe"),
            pytest.param({"moe_latent_size": 24}, id="moe-latent")]


def moe_model(variant=None, device="cpu", dtype=torch.float32, seed=1):
    config = NemotronHConfig.tiny_moe(**(variant or {}))
    return NemotronHModel.random(config, seed=seed, device=device, dtype=dtype)


def moe_layers(model):
    return [b.mixer for b in model.model.layers if b.kind == "E"]


# ---- against transformers ---------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("where", mu.DEVICES)
def test_prefill_and_64_decode_steps_match_transformers(where, variant):
    """In fp32 the routers run free. In bf16 the two models' hidden states differ by bf16
    rounding, enough to flip a near tie between experts and move that token's logits by O(1)
    (seen on the H200: 0.51 at one step, 0.58 on one prompt token, where the dense layout
    stays within 8e-2); so there each of our routing calls takes the experts transformers
    chose in the same call, weighted by our own scores, and our own choices must agree with
    transformers' on all but a few tokens (a wrong router disagrees on most)."""
    device, dtype = where
    model = moe_model(variant, device, dtype)
    if dtype == torch.float32:
        check_matches_transformers(model)
        return
    disagreeing = []
    check_matches_transformers(model, pinned=lambda hf: pinned_to_transformers(
        model, hf, disagreeing))
    calls = len(moe_layers(model)) * (1 + 64)
    tokens = len(moe_layers(model)) * (prompts(device)[0].numel() + 64)
    assert len(disagreeing) == calls
    assert sum(disagreeing) <= 0.05 * tokens, f"{sum(disagreeing)} of {tokens} choices differ"


@contextlib.contextmanager
def pinned_to_transformers(model, hf, disagreeing):
    """Within: our MoE layers take, call by call, the experts the same layer of ``hf`` chose in
    its last call (transformers' NemotronHTopkRouter returns logits, weights, ids); each call
    appends to ``disagreeing`` how many tokens our router would have sent elsewhere."""
    routers = [m for m in hf.modules() if type(m).__name__ == "NemotronHTopkRouter"]
    chosen = {layer: [] for layer in range(len(routers))}
    hooks = [router.register_forward_hook(
        lambda module, args, out, layer=layer: chosen[layer].append(out[2]))
        for layer, router in enumerate(routers)]
    try:
        with routing(model, replay=chosen, disagreeing=disagreeing):
            yield
    finally:
        for hook in hooks:
            hook.remove()


def routing(model, record=None, replay=None, disagreeing=None):
    """mu.pinned_routing over ``model``'s MoE routers (record, or replay weighted by
    :func:`router_weights`), one layer per MoE layer."""
    return mu.pinned_routing([m.gate for m in moe_layers(model)], router_weights, record,
                             replay, disagreeing)


def router_weights(gate, x, ids):
    """The weights ``gate`` (_Router) gives experts ``ids`` for tokens ``x``: their unbiased
    sigmoid scores, normalised where norm_topk_prob, times routed_scaling_factor."""
    c = gate.cfg
    weights = F.linear(x.float(), gate.weight.float()).sigmoid().gather(-1, ids)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * c.routed_scaling_factor


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("where", mu.DEVICES)
@pytest.mark.parametrize("mode", ["eager-bf16", "replay-fp32:4", "replay-bf16:4",
                                  "replay-fp32+bf16:4", "replay-fp32+fp8:4", "replay-fp32+fp8"])
def test_state_modes_match_eager_fp32(where, mode, variant):
    """Each mode against eager fp32 (test_models_nemotron's run and tolerances), each token's
    experts pinned to those it chose in the eager fp32 run. A choice is discontinuous: a lossy
    state's small error can flip a near tie and move that token's logits by O(1) (seen: an fp8
    checkpoint, 0.67 at one step of 48, where the dense layouts stay below 1.5e-2). Pinned,
    the comparison measures the state's precision, and a wrong state still errs by O(1)."""
    device, dtype = where
    model = moe_model(variant, device, dtype)
    chosen = {}
    with routing(model, record=chosen):
        ref, fed = run_teacher_forced(model, "eager-fp32", 48)
    with routing(model, replay=chosen):
        got, _ = run_teacher_forced(model, mode, 48, feed=fed)
    assert not any(chosen.values())  # every call replayed, in the same order
    tol = mu.mode_tolerance(mode, dtype)
    errors = [mu.rel_err(got[s], ref[s]) for s in range(len(ref))]
    assert max(errors) <= tol, f"worst step {errors.index(max(errors))}: {max(errors):.3g} > {tol}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("where", mu.DEVICES_FP32)
def test_replay_fp32_matches_eager_fp32_with_free_routing(where, variant):
    """An fp32 state errs by ~1e-6, far from flipping a choice: replay fp32 against eager fp32
    with the routers free, logits (48 steps) and greedy tokens (256 steps)."""
    device, dtype = where
    model = moe_model(variant, device, dtype)
    check_state_mode(model, "replay-fp32:4")
    _, eager = run_teacher_forced(model, "eager-fp32", 256)
    _, replay = run_teacher_forced(model, "replay-fp32", 256)
    assert torch.equal(replay, eager)


@pytest.mark.parametrize("where", mu.DEVICES)
def test_window_then_commit_equals_single_steps(where):
    """A window's tokens reach the experts as [B, T, H]: the same as T single steps."""
    device, dtype = where
    check_window_then_commit(moe_model({"moe_latent_size": 24}, device, dtype))


@pytest.mark.parametrize("where", mu.DEVICES)
def test_a_rows_logits_do_not_depend_on_the_other_rows(where):
    """Up to rounding, not bit for bit as for the dense layouts: the grouped expert products
    round a row differently with the number of rows that chose the same expert (measured on
    the CPU: 4.8e-6 on one product). The tolerance is the fp32 one against transformers (or
    bf16's); a row given another's state or experts errs by O(1)."""
    device, dtype = where
    tol = 1e-5 if dtype == torch.float32 else mu.BF16_ACTIVATIONS_TOLERANCE
    mu.check_rows_independent(moe_model({}, device, dtype),
                              prompts(device, lengths=(9, 14, 3, 17), seed=8), device, tol=tol)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_captured_step_equals_eager_steps(variant):
    """Routing and the grouped expert products inside a CUDA graph (no host synchronisation)."""
    model = moe_model(variant, "cuda", torch.bfloat16)
    mu.check_captured_step(model, prompts("cuda"))


# ---- the router -------------------------------------------------------------------------------

def _router_case(norm_topk_prob=True):
    """A tiny MoE model whose first MoE router sees scores ``p`` for token 0 (its hidden
    state is a unit vector; the router's weights are the scores' logits along it)."""
    model = moe_model({"norm_topk_prob": norm_topk_prob})
    gate = moe_layers(model)[0].gate
    H = model.config.hidden_size
    p = torch.tensor([0.9, 0.1, 0.1, 0.1,    # group 0: best 0.9, top-2 sum 1.0
                      0.8, 0.7, 0.1, 0.1])   # group 1: best 0.8, top-2 sum 1.5
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[:, 0] = torch.log(p / (1 - p))
        gate.e_score_correction_bias.zero_()
    x = torch.zeros(1, H)
    x[0, 0] = 1
    return gate, x, p


def _sorted_by_expert(ids, weights):
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_keeps_groups_by_their_best_two_and_weighs_by_unbiased_scores(norm_topk_prob):
    """Group 1 wins on its top-2 sum (1.5 > 1.0) though group 0 has the best expert: the
    choice is experts 4 and 5, where an ungrouped top-2 takes 0 and 4 and a group scored by
    its best expert takes 0 and 1. A bias of +0.75 on expert 6 makes it chosen (0.85) but its
    weight is its unbiased score 0.1; the weights are normalised (or not) and times 2.5."""
    gate, x, p = _router_case(norm_topk_prob)

    def expect(chosen):
        w = p[chosen]
        return torch.tensor(chosen), (w / w.sum() if norm_topk_prob else w) * 2.5

    ids, weights = _sorted_by_expert(*gate(x))
    want_ids, want_weights = expect([4, 5])
    assert torch.equal(ids[0], want_ids)
    assert torch.allclose(weights[0], want_weights, rtol=1e-6)
    with torch.no_grad():
        gate.e_score_correction_bias[6] = 0.75
    ids, weights = _sorted_by_expert(*gate(x))
    want_ids, want_weights = expect([4, 6])
    assert torch.equal(ids[0], want_ids)
    assert torch.allclose(weights[0], want_weights, rtol=1e-6)


@pytest.mark.parametrize("groups", [(2, 1), (4, 2), (1, 1)], ids=["2g-keep1", "4g-keep2", "1g"])
def test_router_matches_transformers_router(groups):
    """Random hidden states, weights and bias: the same experts (as sets) and weights as
    transformers' NemotronHTopkRouter, over 256 tokens."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h import modeling_nemotron_h as hf_mod

    n_group, topk_group = groups
    model = moe_model({"n_group": n_group, "topk_group": topk_group,
                       "num_experts_per_tok": 3}, seed=3)
    gate = moe_layers(model)[0].gate
    hf_gate = hf_mod.NemotronHTopkRouter(transformers.NemotronHConfig(**model.config.to_hf()))
    hf_gate.load_state_dict(gate.state_dict())
    x = torch.randn(256, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    ids, weights = _sorted_by_expert(*gate(x))
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_gate(x)
    hf_ids, hf_weights = _sorted_by_expert(hf_ids, hf_weights)
    assert torch.equal(ids, hf_ids)
    assert torch.allclose(weights, hf_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_weights_route_tokens_to_different_experts(variant):
    """random(): the tokens of a prompt, at each MoE layer, choose different experts (every
    expert by some token, both groups), so the tests above exercise routing."""
    model = moe_model(variant)
    chosen = []
    hook = lambda module, args, out: chosen.append(out[0])  # noqa: E731
    handles = [m.gate.register_forward_hook(hook) for m in moe_layers(model)]
    cache = ServingCache(model, 1, 128, "eager-fp32")
    tokens = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(0))
    model.prefill(cache, cache.allocate(), tokens)
    for h in handles:
        h.remove()
    assert len(chosen) == 2
    for ids in chosen:
        assert set(ids.flatten().tolist()) == set(range(8))
        assert len({tuple(sorted(row)) for row in ids.tolist()}) >= 6
        # One group kept per token: a token's experts share a group.
        assert torch.equal(ids.min(-1).values // 4, ids.max(-1).values // 4)


# ---- loading ----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_sharded_loads_and_matches(tmp_path, variant):
    """save_pretrained writes one tensor per expert (backbone.layers.N.mixer.experts.{e}.
    up_proj.weight); models.load stacks them back: every tensor equal, same logits."""
    model = moe_model(variant, seed=4)
    check_save_pretrained_round_trip(model, tmp_path)
    tensors = read_tensors(tmp_path)
    assert "backbone.layers.2.mixer.experts.7.down_proj.weight" in tensors
    assert not any(k.endswith("experts.up_proj") for k in tensors)
    # The score-correction bias loads in fp32 into a bf16 model.
    bf16 = models.load(tmp_path, dtype=torch.bfloat16)
    gate = moe_layers(bf16)[0].gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert gate.weight.dtype == torch.bfloat16
    assert torch.equal(gate.e_score_correction_bias,
                       moe_layers(model)[0].gate.e_score_correction_bias)


def test_stacked_experts_load_too():
    """transformers' in-memory names (stacked [E, I, W] experts, model. prefix) load as well."""
    model = moe_model({"moe_latent_size": 24}, seed=4)
    loaded = NemotronHModel.from_tensors(model.config, model.state_dict())
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, model.state_dict()[name]), name


def test_loader_refuses_missing_misshaped_and_extra_experts_by_name(tmp_path):
    model = moe_model()
    hf_twin(model).save_pretrained(tmp_path)
    tensors = read_tensors(tmp_path)
    cfg = model.config
    expert = "backbone.layers.6.mixer.experts.3.up_proj.weight"
    gate = "backbone.layers.6.mixer.gate.e_score_correction_bias"
    # The same checkpoint with stacked experts, under its backbone. names.
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    stacked.update({"backbone." + k[len("model."):]: v for k, v in model.state_dict().items()
                    if ".experts." in k})
    up2 = "backbone.layers.2.mixer.experts.up_proj"
    cases = [
        ({k: v for k, v in tensors.items() if k != expert}, f"missing tensor {expert}"),
        ({**tensors, expert: torch.zeros(32, 63)},
         f"tensor {expert} has shape \\(32, 63\\), expected \\(32, 64\\)"),
        ({**tensors, "backbone.layers.6.mixer.experts.8.up_proj.weight": torch.zeros(32, 64)},
         "unexpected tensor backbone.layers.6.mixer.experts.8.up_proj.weight"),
        ({k: v for k, v in tensors.items() if k != gate}, f"missing tensor {gate}"),
        ({k: v for k, v in stacked.items() if k != up2}, f"missing tensor {up2}"),
        ({**stacked, up2: torch.zeros(8, 32, 63)},
         f"tensor {up2} has shape \\(8, 32, 63\\), expected \\(8, 32, 64\\)"),
        ({**stacked, expert: tensors[expert]}, f"unexpected tensor {expert}"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            NemotronHModel.from_tensors(cfg, bad)
    assert expert in tensors  # the caller's dict is left as it was
    NemotronHModel.from_tensors(cfg, stacked)  # the stacked checkpoint itself loads


# ---- config -----------------------------------------------------------------------------------

def test_config_round_trips_and_refuses_what_the_family_lacks():
    cfg = NemotronHConfig.tiny_moe(moe_latent_size=24)
    d = cfg.to_hf()
    assert NemotronHConfig.from_hf(d) == cfg
    old = {**{k: v for k, v in d.items() if k != "n_routed_experts"}, "num_local_experts": 8,
           "moe_shared_expert_overlap": False}
    assert NemotronHConfig.from_hf(old) == cfg
    with pytest.raises(ValueError, match="num_local_experts"):
        NemotronHConfig.from_hf({**d, "num_local_experts": 16})
    with pytest.raises(NotImplementedError, match="n_shared_experts"):
        NemotronHConfig.from_hf({**d, "n_shared_experts": 2})
    with pytest.raises(NotImplementedError, match="mlp_hidden_act"):
        NemotronHConfig.from_hf({**d, "mlp_hidden_act": "silu"})
    for bad, message in [(dict(n_group=3), "multiple of n_group"),
                         (dict(n_group=8, topk_group=1), "at least 2 experts"),
                         (dict(topk_group=3), "topk_group \\(3\\) must be at most n_group"),
                         (dict(num_experts_per_tok=5), "num_experts_per_tok \\(5\\) exceeds"),
                         (dict(moe_latent_size=0), "moe_latent_size"),
                         (dict(n_routed_experts=0), "n_routed_experts \\(0\\) must be at least 1")]:
        with pytest.raises(ValueError, match=message):
            NemotronHConfig.tiny_moe(**bad)
    # The MoE fields are not checked where no layer uses them.
    assert NemotronHConfig.tiny(n_group=3).n_group == 3


def test_nano30b_a3b_layout_builds_in_transformers_with_our_weight_shapes():
    """The Nano-30B-A3B preset is a valid transformers config, and its NemotronHForCausalLM (on
    the meta device) has exactly our parameter names and shapes."""
    transformers = pytest.importorskip("transformers")
    cfg = NemotronHConfig.nano30b_a3b()
    assert (cfg.pattern.count("M"), cfg.pattern.count("E"), cfg.pattern.count("*")) == (23, 23, 6)
    with torch.device("meta"):
        hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg.to_hf()))
        ours = NemotronHModel(cfg)
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert shapes["model.layers.1.mixer.experts.up_proj"] == (128, 1856, 2688)
    assert shapes["model.layers.1.mixer.shared_experts.up_proj.weight"] == (3712, 2688)
    # About 31.6e9 parameters, of which the experts hold 29.4e9 (the "30B" of the name).
    total = sum(math.prod(s) for s in shapes.values())
    assert 31e9 < total < 32.5e9
