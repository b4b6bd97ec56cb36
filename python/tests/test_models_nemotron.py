"""The Nemotron-H family against transformers' NemotronHForCausalLM (same weights), each state
mode against eager fp32, speculative windows against single steps, the loader on
save_pretrained output, and rows independent of their batch. Tiny configs; fp32 on the CPU,
bf16 (and fp32) on the GPU (marker ``cuda``)."""

import contextlib
import json
import random

import pytest

torch = pytest.importorskip("torch")

from replayssm import models  # noqa: E402
from replayssm.models import ServingCache  # noqa: E402
from replayssm.models.loader import read_tensors  # noqa: E402
from replayssm.models.nemotron_h import NemotronHConfig, NemotronHModel, ssd_chunk_scan  # noqa: E402

import models_util as mu  # noqa: E402
from models_util import one_cpu_thread  # noqa: E402,F401  (autouse)

PROMPT_LENGTHS = (21, 5, 13)  # across the tiny config's 8-token chunks, and shorter than one


def tiny_model(device="cpu", dtype=torch.float32, seed=1, **overrides):
    return NemotronHModel.random(NemotronHConfig.tiny(**overrides), seed=seed, device=device,
                                 dtype=dtype)


def prompts(device, seed=5, lengths=PROMPT_LENGTHS, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).to(device) for n in lengths]


def hf_twin(model):
    """transformers' NemotronHForCausalLM with ``model``'s weights, device and dtype. MoE
    layers run transformers' eager experts (its reference loop: products in the model's dtype,
    weighted sums in fp32), and their score-correction bias stays fp32, as transformers'
    from_pretrained keeps it (a plain .to(dtype) would round it)."""
    transformers = pytest.importorskip("transformers")
    w = model.lm_head.weight
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        **model.config.to_hf(), experts_implementation="eager"))
    hf = hf.to(device=w.device, dtype=w.dtype).eval()
    for module in hf.modules():
        if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
            module.e_score_correction_bias = module.e_score_correction_bias.float()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf


def int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---- against transformers ---------------------------------------------------------------------

@pytest.mark.parametrize("where", mu.DEVICES)
def test_prefill_and_64_decode_steps_match_transformers(where):
    """Eager fp32 state: the prompt's logits, then 64 greedy steps (transformers' tokens fed to
    both), each step's logits against transformers' cached decoding."""
    device, dtype = where
    check_matches_transformers(tiny_model(device, dtype))


def check_matches_transformers(model, steps=64, pinned=None):
    """``model`` against hf_twin(model): a prompt's logits, then ``steps`` greedy steps, run
    within ``pinned(hf)`` where given (a context manager: the MoE layouts' routing)."""
    dtype = model.lm_head.weight.dtype
    tol = 1e-5 if dtype == torch.float32 else mu.BF16_ACTIVATIONS_TOLERANCE
    hf = hf_twin(model)
    with pinned(hf) if pinned else contextlib.nullcontext():
        _check_matches(model, hf, steps, tol)


def _check_matches(model, hf, steps, tol):
    device = model.lm_head.weight.device
    prompt = prompts(device)[0]
    with torch.no_grad():
        out = hf(prompt[None], use_cache=True)
    cache = ServingCache(model, capacity=2, max_seq_len=128, mode="eager-fp32")
    slot = cache.allocate()
    assert mu.rel_err(model.prefill(cache, slot, prompt), out.logits[0]) <= tol
    past, token = out.past_key_values, out.logits[0, -1].argmax()
    ids = int32([slot], device)
    for step in range(steps):
        with torch.no_grad():
            out = hf(token.view(1, 1), past_key_values=past, use_cache=True)
        past, ref = out.past_key_values, out.logits[0, -1]
        err = mu.rel_err(model.step(cache, ids, token.view(1)), ref[None])
        assert err <= tol, f"step {step}: {err:.3g} > {tol}"
        token = ref.argmax()
    assert int(cache.lengths[slot]) == prompt.numel() + steps


def test_chunked_scan_equals_the_recurrence():
    """The prefill scan against the token-by-token recurrence, over several chunks and a
    partial one, from realistic decays (A < 0, dt of softplus scale)."""
    g = torch.Generator().manual_seed(3)
    n, H, P, G, N = 19, 4, 3, 2, 5
    x, B, C = (torch.randn(s, generator=g, dtype=torch.float64) for s in
               ((n, H, P), (n, G, N), (n, G, N)))
    dt = torch.rand(n, H, generator=g, dtype=torch.float64) * 0.5
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2
    y, final = ssd_chunk_scan(x, dt, A, B, C, chunk_size=4)
    S = torch.zeros(H, P, N, dtype=torch.float64)
    for t in range(n):
        Bh, Ch = B[t].repeat_interleave(H // G, 0), C[t].repeat_interleave(H // G, 0)
        S = torch.exp(dt[t] * A)[:, None, None] * S + dt[t][:, None, None] * x[t][:, :, None] * Bh[:, None]
        assert torch.allclose(y[t], torch.einsum("hpn,hn->hp", S, Ch), atol=1e-12)
    assert torch.allclose(final, S, atol=1e-12)


# ---- state modes ------------------------------------------------------------------------------

def run_teacher_forced(model, mode, steps, feed=None, max_spec_tokens=1):
    """Three rows (prompts of different lengths, so their folds fall on different steps) and a
    pad row, ``steps`` steps; the tokens fed are ``feed[step]`` (3 per step) or each row's
    greedy token. Returns (logits [steps, 3, vocab], tokens fed [steps, 3])."""
    device = model.lm_head.weight.device
    cache = ServingCache(model, capacity=4, max_seq_len=512, mode=mode,
                         max_spec_tokens=max_spec_tokens)
    ps = prompts(device)
    slots = [cache.allocate() for _ in ps]
    last = torch.stack([model.prefill(cache, s, p)[-1] for s, p in zip(slots, ps)])
    ids = int32([slots[0], -1, slots[1], slots[2]], device)
    tokens, logits, fed = last.argmax(-1), [], []
    for step in range(steps):
        if feed is not None:
            tokens = feed[step]
        fed.append(tokens)
        out = model.step(cache, ids, torch.stack([tokens[0], tokens[0], tokens[1], tokens[2]]))
        logits.append(out[[0, 2, 3]])
        tokens = logits[-1].argmax(-1)
    return torch.stack(logits), torch.stack(fed)


@pytest.mark.parametrize("where", mu.DEVICES)
@pytest.mark.parametrize("mode", ["eager-bf16", "replay-fp32:4", "replay-bf16:4",
                                  "replay-fp32+bf16:4", "replay-fp32+fp8:4", "replay-fp32+fp8"])
def test_state_modes_match_eager_fp32(where, mode):
    """Each mode against eager fp32 on the same tokens, 48 steps: with buffer length 4 every row
    folds 12 times, at steps that differ by row."""
    device, dtype = where
    check_state_mode(tiny_model(device, dtype), mode)


def check_state_mode(model, mode):
    """``mode`` against eager fp32 on the same tokens, 48 steps (see the test above)."""
    dtype = model.lm_head.weight.dtype
    ref, fed = run_teacher_forced(model, "eager-fp32", 48)
    got, _ = run_teacher_forced(model, mode, 48, feed=fed)
    tol = mu.mode_tolerance(mode, dtype)
    errors = [mu.rel_err(got[s], ref[s]) for s in range(len(ref))]
    assert max(errors) <= tol, f"worst step {errors.index(max(errors))}: {max(errors):.3g} > {tol}"


@pytest.mark.parametrize("where", mu.DEVICES_FP32)
def test_greedy_tokens_replay_fp32_equal_eager_fp32_over_256_steps(where):
    device, dtype = where
    model = tiny_model(device, dtype)
    _, eager = run_teacher_forced(model, "eager-fp32", 256)
    _, replay = run_teacher_forced(model, "replay-fp32", 256)
    assert torch.equal(replay, eager)


# ---- speculative windows ----------------------------------------------------------------------

@pytest.mark.parametrize("where", mu.DEVICES)
def test_window_then_commit_equals_single_steps(where):
    """replay fp32: a T-token window (T = 4) then commit(k), k random per row (0..T), leaves
    each row where k single steps of the same tokens would: the window's first k logits equal
    the steps', and so do the logits, states and lengths after every window."""
    device, dtype = where
    check_window_then_commit(tiny_model(device, dtype))


def check_window_then_commit(model):
    """The test above's windows and commits on ``model``."""
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    tol = 1e-5 if dtype == torch.float32 else mu.BF16_ACTIVATIONS_TOLERANCE
    T, rng = 4, random.Random(7)
    caches = [ServingCache(model, 3, 256, "replay-fp32:4", max_spec_tokens=T) for _ in range(2)]
    ps = prompts(device)[:2]
    slots = [[c.allocate() for _ in ps] for c in caches]
    assert slots[0] == slots[1]
    for c in caches:
        for s, p in zip(slots[0], ps):
            model.prefill(c, s, p)
    window_cache, step_cache = caches
    ids = int32(slots[0], device)
    g = torch.Generator().manual_seed(11)
    for _ in range(10):
        window = torch.randint(0, 128, (2, T), generator=g).to(device)
        k = [rng.randint(0, T) for _ in slots[0]]
        logits = model.decode(window_cache, ids, window)
        model.commit(window_cache, ids, int32(k, device))
        for t in range(max(k)):
            # Rows that accepted fewer than t + 1 tokens sit out as pad rows.
            step_ids = int32([s if t < kb else -1 for s, kb in zip(slots[0], k)], device)
            out = model.step(step_cache, step_ids, window[:, t])
            for b, kb in enumerate(k):
                if t < kb:
                    assert mu.rel_err(logits[b, t], out[b]) <= tol
        assert torch.equal(window_cache.lengths, step_cache.lengths)
    probe = torch.randint(0, 128, (2, 1), generator=g).to(device)
    assert mu.rel_err(model.decode(window_cache, ids, probe), model.decode(step_cache, ids, probe)) <= tol
    for layer in range(model.config.pattern.count("M")):
        for s in slots[0]:
            got = window_cache.ssm.export_state(layer, s)
            assert mu.rel_err(got, step_cache.ssm.export_state(layer, s)) <= tol


def test_windows_past_max_spec_tokens_and_bad_input_leave_the_cache_untouched():
    model = tiny_model()
    cache = ServingCache(model, 2, 64, "eager-fp32", max_spec_tokens=4)
    slot = cache.allocate()
    model.prefill(cache, slot, prompts("cpu")[1])
    before = [t.clone() for t in (cache.lengths, cache.conv, cache.k, cache.v)]
    with pytest.raises(ValueError, match="max_spec_tokens"):
        model.decode(cache, int32([slot], "cpu"), torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_ids must be int32"):
        model.decode(cache, torch.tensor([slot]), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="batch"):
        model.decode(cache, int32([slot], "cpu"), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model.prefill(cache, cache.allocate(), torch.zeros(65, dtype=torch.long))
    after = (cache.lengths, cache.conv, cache.k, cache.v)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match="unknown replay precision"):
        ServingCache(model, 2, 64, "replay-fp16")


# ---- batches ----------------------------------------------------------------------------------

@pytest.mark.parametrize("where", mu.DEVICES)
def test_a_rows_logits_do_not_depend_on_the_other_rows(where):
    """Row 0 beside other sequences, pad rows and a late joiner: mu.check_rows_independent."""
    device, dtype = where
    mu.check_rows_independent(tiny_model(device, dtype), prompts(device, lengths=(9, 14, 3, 17), seed=8), device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_step_equals_eager_steps():
    """model.step captured in a CUDA graph (bf16, replay fp32, a pad row) and replayed, against
    the same steps run eagerly on a second cache: identical logits across folds."""
    model = tiny_model("cuda", torch.bfloat16)
    mu.check_captured_step(model, prompts("cuda"))


# ---- loading ----------------------------------------------------------------------------------

def test_save_pretrained_sharded_loads_and_matches(tmp_path):
    """transformers writes a tiny model in shards (index file); models.load reads it back:
    every tensor equal, and the same prefill logits as the model it came from."""
    check_save_pretrained_round_trip(tiny_model(seed=4), tmp_path)


def check_save_pretrained_round_trip(model, tmp_path):
    """hf_twin(model) saved in shards, read back by models.load: the test above."""
    hf_twin(model).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())
                   ["weight_map"].values())) > 1
    loaded = models.load(tmp_path)
    assert isinstance(loaded, NemotronHModel) and loaded.config == model.config
    ours = model.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, ours[name]), name
    p = prompts("cpu")[0]
    logits = []
    for m in (model, loaded):
        cache = ServingCache(m, 1, 64, "replay-fp32")
        logits.append(m.prefill(cache, cache.allocate(), p))
    assert torch.equal(logits[0], logits[1])


def test_loader_refuses_missing_misshaped_and_unknown_tensors_by_name(tmp_path):
    model = tiny_model()
    hf_twin(model).save_pretrained(tmp_path)
    tensors = read_tensors(tmp_path)
    cfg = model.config
    name = next(k for k in tensors if k.endswith("layers.3.mixer.A_log"))
    cases = [
        ({k: v for k, v in tensors.items() if k != name}, f"missing tensor {name}"),
        ({**tensors, name: torch.zeros(3)}, f"tensor {name} has shape \\(3,\\), expected \\(8,\\)"),
        ({**tensors, "model.layers.0.mixer.extra": torch.zeros(1)}, "unexpected tensor"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            NemotronHModel.from_tensors(cfg, bad)
    # The same refusal through a model directory.
    from safetensors.torch import save_file
    (tmp_path / "model.safetensors").unlink()
    save_file({k: v for k, v in tensors.items() if k != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"missing tensor {name}"):
        models.load(tmp_path)


def test_config_round_trips_and_refuses_what_the_family_lacks():
    cfg = NemotronHConfig.tiny()
    assert NemotronHConfig.from_hf(cfg.to_hf()) == cfg
    listed = {**cfg.to_hf(), "layers_block_type": ["mamba", "attention", "mlp", "mamba", "mlp",
                                                   "mamba", "attention", "mlp"]}
    del listed["hybrid_override_pattern"]
    assert NemotronHConfig.from_hf(listed) == cfg
    with pytest.raises(ValueError, match="each layer is one of"):
        NemotronHConfig.tiny(pattern="MX*")
    with pytest.raises(NotImplementedError, match="mlp_hidden_act"):
        NemotronHConfig.from_hf({**cfg.to_hf(), "mlp_hidden_act": "silu"})
    with pytest.raises(ValueError, match="unsupported model_type"):
        models.load({"model_type": "llama"})


def test_nano4b_layout_builds_in_transformers_with_our_weight_shapes():
    """The Nano-4B preset is a valid transformers config, and its NemotronHForCausalLM (on the
    meta device: no memory) has exactly our parameter names and shapes."""
    transformers = pytest.importorskip("transformers")
    cfg = NemotronHConfig.nano4b()
    assert (cfg.pattern.count("M"), cfg.pattern.count("*"), cfg.pattern.count("-")) == (21, 4, 17)
    with torch.device("meta"):
        hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg.to_hf()))
        ours = NemotronHModel(cfg)
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert shapes["model.layers.0.mixer.in_proj.weight"] == (2 * 7680 + 2 * 8 * 128 + 96, 3136)
    layout = ours.cache_layout()
    assert layout.ssm_dims == dict(num_heads=96, head_dim=80, state_dim=128, num_groups=8)
