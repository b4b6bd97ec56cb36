"""The Qwen3.5 family against transformers' Qwen3_5ForCausalLM (same weights), each state mode
against eager fp32, speculative windows against single steps, the loader on save_pretrained
output and on the published checkpoints' layout, and rows independent of their batch. Tiny
configs; fp32 on the CPU, bf16 (and fp32) on the GPU (marker ``cuda``).

Errors are max |got - ref| / max |ref| over a whole run of steps. The tiny random model is
sensitive: on random keys the delta rule's state is ill-conditioned and the GDN output norm
divides each head by its RMS, so rounding grows through the stack (bf16 activations move
transformers' own logits by ~10% against its fp32 run). Hence tolerances of this family's own,
each about 3x what was measured (CPU, seeds below) and far below the O(1) error of a wrong
state.
"""

import json

import pytest

torch = pytest.importorskip("torch")

from replayssm.models import ServingCache, StateMode  # noqa: E402
from replayssm.models import base  # noqa: E402
from replayssm.models import qwen3_5 as qw  # noqa: E402
from replayssm.models.loader import read_tensors  # noqa: E402

import models_util as mu  # noqa: E402
from models_util import one_cpu_thread  # noqa: E402,F401  (autouse)

#: Eager fp32 state against transformers, fp32 activations: 1.1e-5 measured (the decode op and
#: the chunked scan sum in another order than transformers' loops).
FP32_TOL = 5e-5
#: Each state mode against eager fp32, fp32 activations, 70 steps (4 folds at L = 16, 17 at
#: L = 4). Measured: fp32 replay 2.6e-5; bf16 state 7.9e-3 on the CPU, 6.0e-2 on the H200 (the
#: kernels round the same bf16 state in another order, and this tiny random model amplifies it:
#: see the bf16 test against transformers); bf16 checkpoints 7.2e-4 (L = 16), 1.9e-2 (L = 4:
#: more reads of a freshly rounded copy); fp8 read copy 1.1e-2.
MODE_TOL = {"eager-bf16": 1e-1, "replay-fp32": 1e-4, "replay-bf16": 5e-2,
            "replay-fp32+bf16": 5e-2, "replay-fp32+fp8": 5e-2}


def tiny_model(device="cpu", dtype=torch.float32, seed=3, **overrides):
    return qw.Qwen35Model.random(qw.tiny_config(**overrides), seed=seed, device=device,
                                 dtype=dtype)


def prompt(n, seed=0, device="cpu", vocab=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).to(device)


def int32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def run_err(got, ref):
    """rel_err of a run: lists of step logits, against the run's largest |logit|."""
    return mu.rel_err(torch.stack(got), torch.stack(ref))


def hf_twin(model):
    """transformers' Qwen3_5ForCausalLM (Qwen3_5MoeForCausalLM for a MoE config) with
    ``model``'s weights, device and dtype."""
    transformers = pytest.importorskip("transformers")
    moe = isinstance(model.config, qw.Qwen35MoeConfig)
    cls, config_cls = (("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig") if moe else
                       ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"))
    if not hasattr(transformers, cls):
        pytest.skip(f"this transformers has no {cls}")
    d = model.config.to_hf()
    del d["model_type"], d["architectures"]
    config = getattr(transformers, config_cls)(**d)
    if moe:
        # The experts class's own loop (one expert at a time, summed in the activations'
        # dtype), not whichever kernel the installed PyTorch lets transformers pick.
        config._experts_implementation = "eager"
    return with_our_weights(getattr(transformers, cls)(config), model)


def with_our_weights(hf, model):
    """transformers' model ``hf`` given ``model``'s weights (its state_dict, every name
    matched), device and dtype."""
    missing, unexpected = hf.load_state_dict(
        {k: v.float().cpu() for k, v in model.state_dict().items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    w = model.lm_head.weight
    hf = hf.to(device=w.device, dtype=w.dtype).eval()
    # .to(bfloat16) rounds the rotary inverse frequencies; from_pretrained in bf16 keeps them
    # fp32, as our model does.
    rot = hf.model.rotary_emb
    rot.inv_freq = rot.compute_default_rope_parameters(hf.config, w.device)[0]
    return hf


@torch.no_grad()
def hf_run(hf, tokens, steps, forced=None):
    """transformers with its cache: (prompt logits [n, vocab], step logits, tokens fed),
    greedy or feeding ``forced``."""
    out = hf(tokens[None], use_cache=True)
    first, past = out.logits[0].float(), out.past_key_values
    logits, fed = [], []
    nxt = first[-1].argmax()
    for t in range(steps):
        fed.append(int(nxt) if forced is None else forced[t])
        out = hf(torch.tensor([[fed[-1]]], device=tokens.device), past_key_values=past,
                 use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1].float())
        nxt = logits[-1].argmax()
    return first, logits, fed


def our_run(model, mode, tokens, steps, forced=None, **cache_kw):
    """The same for our model served in ``mode`` (one slot, model.step)."""
    device = tokens.device
    cache = ServingCache(model, 2, tokens.numel() + steps + 1, mode, **cache_kw)
    slot = cache.allocate()
    first = model.prefill(cache, slot, tokens)
    ids = int32([slot], device)
    logits, fed = [], []
    nxt = first[-1].argmax()
    for t in range(steps):
        fed.append(int(nxt) if forced is None else forced[t])
        logits.append(model.step(cache, ids, torch.tensor([fed[-1]], device=device))[0])
        nxt = logits[-1].argmax()
    assert int(cache.lengths[slot]) == tokens.numel() + steps
    return first, logits, fed


# ---- the prefill scan -------------------------------------------------------------------------

def gated_delta_loop(q, k, v, g, beta, state):
    """The gated delta rule token by token in float64; S [H, V, K]."""
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, state))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
        S = S + delta[:, :, None] * k[t][:, None, :]
        out.append(torch.einsum("hvk,hk->hv", S, q[t]))
    return torch.stack(out), S


@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("n", [1, 100])
def test_chunked_scan_matches_a_float64_loop(n, chunk):
    """Across several chunks and a partial one, from a non-zero state, with decays from near 1
    to strong (exp(-8)) and update rates in (0, 1)."""
    gen = torch.Generator().manual_seed(n + chunk)
    H, K, V = 4, 16, 8
    q, k = torch.randn(n, H, K, generator=gen), torch.randn(n, H, K, generator=gen)
    v = torch.randn(n, H, V, generator=gen)
    g = -torch.rand(n, H, generator=gen) * torch.tensor([0.01, 0.3, 2.0, 8.0])
    beta = torch.rand(n, H, generator=gen)
    state = torch.randn(H, V, K, generator=gen)
    o, S = qw.gated_delta_chunked(q, k, v, g, beta, state, chunk=chunk)
    o_ref, S_ref = gated_delta_loop(q, k, v, g, beta, state)
    assert o.dtype == S.dtype == torch.float32
    assert mu.rel_err(o, o_ref) < 1e-5 and mu.rel_err(S, S_ref) < 1e-5


# ---- against transformers ---------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_prefill_and_64_greedy_steps_match_transformers_fp32(tied):
    """Eager fp32 state, fp32 on the CPU: the prompt's logits (100 tokens: two chunks of the
    scan and a partial one), then 64 greedy steps with the same tokens chosen, each step's
    logits against transformers' cached decoding."""
    check_matches_transformers_fp32(tiny_model(seed=1, tie_word_embeddings=tied))


def check_matches_transformers_fp32(model, twin=None):
    """An fp32 model on the CPU against its transformers twin (``twin``, default
    :func:`hf_twin`): a 100-token prompt's logits, then 64 greedy steps choosing the same
    tokens, within FP32_TOL."""
    tokens = prompt(100)
    first_ref, steps_ref, fed_ref = hf_run((twin or hf_twin)(model), tokens, 64)
    first, steps, fed = our_run(model, "eager-fp32", tokens, 64)
    assert mu.rel_err(first, first_ref) < FP32_TOL
    assert fed == fed_ref
    assert run_err(steps, steps_ref) < FP32_TOL


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=mu.DEVICES[1].marks)])
def test_bf16_error_within_twice_transformers_own(device):
    """bf16 weights and activations: against transformers in fp32 (same weights, its greedy
    tokens fed to all three), our error stays within twice transformers' bf16 error, over the
    prompt and over 64 steps at worst and on average."""
    check_bf16_error_within_twice_transformers(tiny_model(device, torch.bfloat16, seed=2),
                                               tiny_model(device, seed=2))


def check_bf16_error_within_twice_transformers(model, model32, twin=None):
    """``model`` (bf16) and ``model32`` (the same weights in fp32) against transformers' twins
    (``twin``, default :func:`hf_twin`):
    transformers in fp32 gives the reference and the fed tokens; our bf16 error stays within
    twice transformers' bf16 error over a 37-token prompt and 64 steps, at worst and on
    average."""
    device = next(model.parameters()).device
    twin = twin or hf_twin
    hf, hf32 = twin(model), twin(model32)
    tokens = prompt(37, seed=1, device=device)
    first32, steps32, fed = hf_run(hf32, tokens, 64)
    first_hf, steps_hf, _ = hf_run(hf, tokens, 64, forced=fed)
    first, steps, _ = our_run(model, "eager-fp32", tokens, 64, forced=fed)
    assert mu.rel_err(first, first32) <= 2 * mu.rel_err(first_hf, first32)
    ours, theirs = step_errors(steps, steps32), step_errors(steps_hf, steps32)
    assert ours.max() <= 2 * theirs.max() and ours.mean() <= 2 * theirs.mean(), (ours, theirs)


# ---- state modes ------------------------------------------------------------------------------

@pytest.mark.parametrize("where", mu.DEVICES_FP32)
@pytest.mark.parametrize("mode", [m for m in StateMode.NAMES if m != "eager-fp32"] +
                         ["replay-fp32:4", "replay-fp32+bf16:4"])
def test_state_modes_match_eager_fp32(where, mode):
    """70 teacher-forced steps after a 21-token prompt (4 folds at L = 16, 17 at L = 4)."""
    device, dtype = where
    steps, steps_ref = state_mode_runs(tiny_model(device, dtype), mode)
    assert run_err(steps, steps_ref) < MODE_TOL[mode.split(":")[0]]


@pytest.mark.parametrize("where", mu.DEVICES_FP32)
@pytest.mark.parametrize("mode,fold_every", [("replay-fp32", 1), ("replay-fp32+bf16", 3)])
def test_a_shorter_fold_cadence_matches_eager_fp32(where, mode, fold_every):
    """The same runs with every GDN decode folding every ``fold_every`` tokens (the cadence
    the cache applies on a GPU at small batches, here set for every batch)."""
    device, dtype = where
    steps, steps_ref = state_mode_runs(tiny_model(device, dtype), mode, fold_every=fold_every)
    assert run_err(steps, steps_ref) < MODE_TOL[mode]


@pytest.mark.parametrize("where", mu.DEVICES_FP32)
@pytest.mark.parametrize("mode", ["replay-fp32+bf16", "replay-fp32+fp8"])
def test_folding_every_f_tokens_equals_a_cache_of_buffer_len_f(where, mode):
    """fold_every = 5 on a cache of L = 16 computes what a cache of L = 5 computes, bit for
    bit: the cadence is the whole of L's effect on outputs."""
    device, dtype = where
    model, tokens = tiny_model(device, dtype), prompt(21, seed=4, device=device)
    stream = prompt(40, seed=5).tolist()
    _, steps, _ = our_run(model, mode, tokens, 40, forced=stream, fold_every=5)
    _, steps_l5, _ = our_run(model, f"{mode}:5", tokens, 40, forced=stream)
    assert all(torch.equal(a, b) for a, b in zip(steps, steps_l5))


def test_the_fold_cadence_rule_and_its_refusals():
    """default_fold_every: GDN single tokens on a GPU up to the batch limit fold every
    GDN_SHORT_FOLD_EVERY tokens (never past L) with an fp32 master; Mamba-2, windows, larger
    batches, the CPU and the bf16 and fp32+fp8 checkpoints keep L (0). ServingCache refuses
    cadences outside [1, L], and any on an eager mode."""
    rule, limit = base.default_fold_every, base.GDN_SHORT_FOLD_MAX_BATCH
    for p in ("fp32", "fp32+bf16"):
        assert rule("gdn", p, 1, 1, 16, True) == rule("gdn", p, limit, 1, 16, True) == \
            base.GDN_SHORT_FOLD_EVERY
    assert rule("gdn", "fp32", 1, 1, 2, True) == 2
    assert rule("gdn", "fp32", limit + 1, 1, 16, True) == rule("gdn", "fp32", 1, 4, 16, True) == 0
    assert rule("mamba2", "fp32", 1, 1, 16, True) == rule("gdn", "fp32", 1, 1, 16, False) == 0
    assert rule("gdn", "bf16", 1, 1, 16, True) == rule("gdn", "fp32+fp8", 1, 1, 16, True) == 0
    model = tiny_model("cpu", torch.float32)
    assert ServingCache(model, 2, 8, "replay-fp32", fold_every=3).fold_every("gdn", 1, 1) == 3
    assert ServingCache(model, 2, 8, "eager-fp32").fold_every("gdn", 1, 1) == 0
    for mode, bad in (("replay-fp32", 17), ("replay-fp32", -1), ("replay-fp32:4", 5),
                      ("eager-fp32", 2), ("replay-fp32", "every")):
        with pytest.raises(ValueError, match="fold_every"):
            ServingCache(model, 2, 8, mode, fold_every=bad)


def step_errors(got, ref):
    """rel_err of each step: lists of step logits."""
    return torch.tensor([mu.rel_err(a, b) for a, b in zip(got, ref)])


def state_mode_runs(model, mode, routing=None, **cache_kw):
    """The step logits of ``mode`` and of eager fp32 over 70 teacher-forced steps after a
    21-token prompt (4 folds at L = 16, 17 at L = 4); the prefill's logits equal, as every mode
    loads the same fp32 prefill state; ``cache_kw`` go to the mode's ServingCache. With ``routing`` (a MoE family's context manager,
    routing(model, record=...) or routing(model, replay=...): see mu.pinned_routing), the
    eager fp32 run records its routers' choices and the mode's run replays them call by call."""
    device = next(model.parameters()).device
    tokens, stream = prompt(21, seed=4, device=device), prompt(70, seed=5).tolist()
    if routing is None:
        first_ref, steps_ref, _ = our_run(model, "eager-fp32", tokens, 70, forced=stream)
        first, steps, _ = our_run(model, mode, tokens, 70, forced=stream, **cache_kw)
    else:
        chosen = {}
        with routing(model, record=chosen):
            first_ref, steps_ref, _ = our_run(model, "eager-fp32", tokens, 70, forced=stream)
        with routing(model, replay=chosen):
            first, steps, _ = our_run(model, mode, tokens, 70, forced=stream, **cache_kw)
        assert chosen and not any(chosen.values())  # every call replayed, in the same order
    assert torch.equal(first, first_ref)
    return steps, steps_ref


@pytest.mark.parametrize("where", mu.DEVICES_FP32)
def test_greedy_tokens_replay_fp32_equal_eager_fp32_over_256_steps(where):
    device, dtype = where
    check_greedy_tokens_replay_fp32_equal_eager_fp32(tiny_model(device, dtype))


def check_greedy_tokens_replay_fp32_equal_eager_fp32(model):
    """256 greedy steps after a 9-token prompt, replay fp32 against eager fp32: the same
    tokens chosen, the logits within MODE_TOL (measured 8.8e-6 over the run). A MoE model's
    routers run free: an fp32 state's error is far from flipping a choice."""
    device = next(model.parameters()).device
    tokens = prompt(9, seed=6, device=device)
    _, steps_e, fed_e = our_run(model, "eager-fp32", tokens, 256)
    _, steps_r, fed_r = our_run(model, "replay-fp32", tokens, 256)
    assert fed_r == fed_e
    assert run_err(steps_r, steps_e) < MODE_TOL["replay-fp32"]


# ---- windows and batches ----------------------------------------------------------------------

@pytest.mark.parametrize("where", mu.DEVICES_FP32)
def test_window_then_commit_equals_single_steps(where):
    """Rows of different lengths (and a pad row) decode 4-token windows and accept 0 to 4 of
    their tokens; a second cache steps the accepted tokens one by one: the same logits for the
    accepted tokens, window after window, and the same lengths and states at the end."""
    device, dtype = where
    model = tiny_model(device, dtype)
    gen = torch.Generator().manual_seed(7)
    spec = ServingCache(model, 4, 256, "replay-fp32", max_spec_tokens=4)
    single = ServingCache(model, 4, 256, "replay-fp32")
    slots = []
    for n in (5, 12, 1):
        p = prompt(n, seed=n, device=device)
        a, b = spec.allocate(), single.allocate()
        model.prefill(spec, a, p)
        model.prefill(single, b, p)
        slots.append((a, b))
    ids = int32([a for a, _ in slots] + [-1], device)
    for _ in range(12):
        window = torch.randint(0, 96, (4, 4), generator=gen).to(device)
        accepted = torch.randint(0, 5, (4,), generator=gen, dtype=torch.int32)
        logits = model.decode(spec, ids, window)
        model.commit(spec, ids, accepted.to(device))
        for r, (_, b) in enumerate(slots):
            for t in range(int(accepted[r])):
                ref = model.step(single, int32([b], device), window[r, t:t + 1])[0]
                assert mu.rel_err(logits[r, t], ref) < MODE_TOL["replay-fp32"]
    for a, b in slots:
        assert int(spec.lengths[a]) == int(single.lengths[b])
        for layer in range(len(model.config.ssm_layers)):
            assert mu.rel_err(spec.ssm.export_state(layer, a),
                              single.ssm.export_state(layer, b)) < MODE_TOL["replay-fp32"]


def test_windows_past_max_spec_tokens_and_bad_input_leave_the_cache_untouched():
    model = tiny_model()
    cache = ServingCache(model, 2, 64, "eager-fp32", max_spec_tokens=4)
    slot = cache.allocate()
    model.prefill(cache, slot, prompt(5))
    before = [t.clone() for t in (cache.lengths, cache.conv, cache.k, cache.v)]
    state = cache.ssm.export_state(0, slot)
    with pytest.raises(ValueError, match="max_spec_tokens"):
        model.decode(cache, int32([slot]), torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch"):
        model.decode(cache, int32([slot]), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model.prefill(cache, cache.allocate(), torch.zeros(65, dtype=torch.long))
    after = (cache.lengths, cache.conv, cache.k, cache.v)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert torch.equal(cache.ssm.export_state(0, slot), state)


@pytest.mark.parametrize("where", mu.DEVICES)
def test_a_rows_logits_do_not_depend_on_the_other_rows(where):
    """Row 0 beside other sequences, pad rows and a late joiner: mu.check_rows_independent."""
    device, dtype = where
    mu.check_rows_independent(tiny_model(device, dtype), [prompt(n, seed=8 + n, device=device) for n in (9, 14, 3, 17)], device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_step_equals_eager_steps():
    """model.step captured in a CUDA graph (bf16, replay fp32, a pad row) and replayed, against
    the same steps run eagerly on a second cache: identical logits across folds."""
    model = tiny_model("cuda", torch.bfloat16)
    mu.check_captured_step(model, [prompt(n, seed=n, device="cuda") for n in (21, 5, 13)])


# ---- loading ----------------------------------------------------------------------------------

def same_prefill(a, b, tokens):
    logits = []
    for m in (a, b):
        cache = ServingCache(m, 1, 64, "replay-fp32")
        logits.append(m.prefill(cache, cache.allocate(), tokens))
    return torch.equal(*logits)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_pretrained_sharded_loads_and_matches(tmp_path, tied):
    """transformers writes a tiny model in shards (index file); from_pretrained reads it
    back through the shared loader: every tensor equal, the same prefill logits."""
    model = tiny_model(seed=4, tie_word_embeddings=tied)
    hf_twin(model).save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = qw.Qwen35Model.from_pretrained(tmp_path)
    assert loaded.config == model.config
    ours = model.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, ours[name]), name
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert same_prefill(model, loaded, prompt(11))


def test_published_checkpoint_layout_loads(tmp_path):
    """The hub's Qwen3.5 checkpoints: model_type qwen3_5 with the text tower in text_config,
    tie_word_embeddings beside it, weights under model.language_model.*, and a vision tower and
    a multi-token-prediction head that a text decoder skips."""
    save_file = pytest.importorskip("safetensors.torch").save_file

    model = tiny_model(seed=5, tie_word_embeddings=True)
    text = model.config.to_hf()
    del text["tie_word_embeddings"], text["architectures"]
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "tie_word_embeddings": True, "text_config": text,
              "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {k.replace("model.", "model.language_model.", 1): v.clone()
               for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 3)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = qw.Qwen35Model.from_pretrained(tmp_path)
    assert loaded.config == model.config
    assert same_prefill(model, loaded, prompt(11))


def test_loader_refuses_missing_misshaped_and_unknown_tensors_by_name(tmp_path):
    model = tiny_model()
    hf_twin(model).save_pretrained(tmp_path)
    tensors = read_tensors(tmp_path)
    name = "model.layers.3.linear_attn.A_log"
    cases = [
        ({k: v for k, v in tensors.items() if k != name}, f"missing tensor {name}"),
        ({**tensors, name: torch.zeros(3)}, f"tensor {name} has shape \\(3,\\), expected \\(4,\\)"),
        ({**tensors, "model.layers.0.linear_attn.extra": torch.zeros(1)}, "unexpected tensor"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            qw.Qwen35Model.from_tensors(model.config, bad)


def test_config_round_trips_and_refuses_what_the_family_lacks():
    cfg = qw.tiny_config()
    assert qw.Qwen35Config.from_hf(cfg.to_hf()) == cfg
    assert qw.Qwen35Config.from_hf(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ValueError, match="layer_types has 2 entries for 6 layers"):
        qw.tiny_config(layer_types=("linear_attention", "full_attention"))
    assert qw.tiny_config(layer_types=("mamba", "attention") * 3).layer_types == (
        ("linear_attention", "full_attention") * 3)  # older names, mapped as transformers does
    with pytest.raises(ValueError, match="unknown layer types"):
        qw.tiny_config(layer_types=("sliding_attention",) * 6)
    with pytest.raises(ValueError, match="output gate"):
        qw.Qwen35Config.from_hf({**cfg.to_hf(), "attn_output_gate": False})
    with pytest.raises(ValueError, match="rope_type"):
        qw.Qwen35Config.from_hf({**cfg.to_hf(), "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        qw.tiny_config(linear_num_value_heads=3)


def test_qwen35_4b_layout_builds_in_transformers_with_our_weight_shapes():
    """The 4B preset is a valid transformers config, and its Qwen3_5ForCausalLM (on the meta
    device: no memory) has exactly our parameter names and shapes; its GDN layers are the
    layer benchmark's qwen35-4b shape."""
    transformers = pytest.importorskip("transformers")
    cfg = qw.QWEN35_4B
    assert (len(cfg.ssm_layers), len(cfg.attention_layers)) == (24, 8)
    assert cfg.attention_layers == list(range(3, 32, 4))
    assert cfg.gdn_dims == dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    d = cfg.to_hf()
    del d["model_type"], d["architectures"]
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**d))
        ours = qw.Qwen35Model(cfg)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert theirs == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
