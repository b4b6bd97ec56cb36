"""The Qwen3.5 family (replayssm.models.qwen3_5) against transformers' Qwen3_5ForCausalLM and
against itself across state modes.

- The chunked prefill scan against a float64 loop of the gated delta rule.
- Same weights as transformers on tiny configs: prefill logits and >= 64 greedy decode steps
  (CPU fp32 tightly; bf16 within bf16 tolerance on the CPU and, marked ``cuda``, on a GPU).
- Every state mode against eager fp32 over several folds (teacher-forced, so the streams stay
  the same); greedy tokens of replay fp32 and eager fp32 identical over 256 steps.
- save_pretrained output (sharded) and a published-layout directory load and match.
- A T-token window committed k tokens = k single steps; a row's output does not depend on the
  rows beside it (pad rows and staggered starts included).

Tolerances are relative to the largest |logit| of the reference step: fp32 paths agree to
~2e-5 (the decode op and the chunked scan sum in another order than transformers' loops);
a bf16 state or checkpoint rounds the state to 2^-8 relative; fp8 read copies to 2^-4.
"""

import json

import pytest

torch = pytest.importorskip("torch")

import replayssm  # noqa: E402
from replayssm.models import ServingCache, StateMode  # noqa: E402
from replayssm.models import qwen3_5 as qw  # noqa: E402

FP32_TOL = 1e-4
# Replay / eager-bf16 state vs eager fp32 state, same fp32 activations.
MODE_TOL = {"eager-bf16": 5e-2, "replay-fp32": 1e-4, "replay-bf16": 5e-2,
            "replay-fp32+bf16": 5e-2, "replay-fp32+fp8": 5e-2}

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread. On a loaded 2-core machine torch's thread pool turned
    each 1x48 matmul into a millisecond (55 ms a step instead of 3)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and replayssm.cuda_available()),
                          reason="needs a CUDA GPU, PyTorch with CUDA and a CUDA build")


def rel_err(got, ref):
    """max |got - ref| / max |ref|: logits [..., vocab], or lists of steps' logits (a run,
    measured against the run's largest logit)."""
    if isinstance(got, list):
        got, ref = torch.stack(got), torch.stack(ref)
    got, ref = got.float().cpu(), ref.float().cpu()
    assert torch.isfinite(got).all(), "non-finite logits"
    return ((got - ref).abs().max() / ref.abs().max()).item()


def prompt(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def transformers_twin(model):
    """transformers' Qwen3_5ForCausalLM with ``model``'s weights, dtype and device."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("this transformers has no Qwen3_5ForCausalLM")
    d = model.config.to_hf()
    del d["model_type"], d["architectures"]
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**d))
    hf.load_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()})
    w = model.lm_head.weight
    hf = hf.to(device=w.device, dtype=w.dtype).eval()
    # model.to(bfloat16) rounds the rotary inverse frequencies; a bf16 checkpoint loaded by
    # from_pretrained keeps them in fp32, as our model does.
    rot = hf.model.rotary_emb
    rot.inv_freq = rot.compute_default_rope_parameters(hf.config, w.device)[0]
    return hf


@torch.no_grad()
def transformers_greedy(hf, tokens, steps, forced=None):
    """(logits of the prompt [n, vocab], [steps] step logits, the tokens fed): greedy, or the
    ``forced`` tokens when given."""
    out = hf(tokens[None].to(hf.device), use_cache=True)
    first, cache = out.logits[0].float(), out.past_key_values
    nxt = first[-1].argmax() if forced is None else forced[0]
    logits, fed = [], []
    for t in range(steps):
        fed.append(int(nxt))
        out = hf(torch.tensor([[fed[-1]]], device=hf.device), past_key_values=cache,
                 use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[0, -1].float())
        nxt = logits[-1].argmax() if forced is None else forced[min(t + 1, len(forced) - 1)]
    return first, logits, fed


def ours_greedy(model, mode, tokens, steps, forced=None, **cache_kw):
    """The same for our model served in ``mode``."""
    device = model.lm_head.weight.device
    cache = ServingCache(model, capacity=2, max_seq_len=tokens.numel() + steps + 1, mode=mode,
                         **cache_kw)
    slot = cache.allocate()
    first = model.prefill(cache, slot, tokens.to(device))
    slot_ids = torch.tensor([slot], dtype=torch.int32, device=device)
    nxt = first[-1].argmax() if forced is None else forced[0]
    logits, fed = [], []
    for t in range(steps):
        fed.append(int(nxt))
        logits.append(model.step(cache, slot_ids, torch.tensor([fed[-1]], device=device))[0])
        nxt = logits[-1].argmax() if forced is None else forced[min(t + 1, len(forced) - 1)]
    return first, logits, fed


# ---- the prefill scan -------------------------------------------------------------------------

def gated_delta_loop(q, k, v, g, beta, state):
    """The gated delta rule token by token in float64: S [H, V, K]."""
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
def test_chunked_scan_matches_float64_loop(n, chunk):
    gen = torch.Generator().manual_seed(n + chunk)
    H, K, V = 4, 16, 8
    q, k = torch.randn(n, H, K, generator=gen), torch.randn(n, H, K, generator=gen)
    v = torch.randn(n, H, V, generator=gen)
    # Realistic decays (some near 1, some strong) and update rates.
    g = -torch.rand(n, H, generator=gen) * torch.tensor([0.01, 0.3, 2.0, 8.0])
    beta = torch.rand(n, H, generator=gen)
    state = torch.randn(H, V, K, generator=gen)
    o, S = qw.gated_delta_chunked(q, k, v, g, beta, state, chunk=chunk)
    o_ref, S_ref = gated_delta_loop(q, k, v, g, beta, state)
    assert o.dtype == S.dtype == torch.float32
    assert (o.double() - o_ref).abs().max() < 1e-5 * o_ref.abs().max()
    assert (S.double() - S_ref).abs().max() < 1e-5 * S_ref.abs().max()


# ---- against transformers ---------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matches_transformers_cpu_fp32(tied):
    model = qw.Qwen35Model.random(qw.tiny_config(tie_word_embeddings=tied), seed=1)
    hf = transformers_twin(model)
    tokens = prompt(37, model.config.vocab_size)
    first_ref, steps_ref, fed_ref = transformers_greedy(hf, tokens, 64)
    first, steps, fed = ours_greedy(model, "eager-fp32", tokens, 64)
    assert rel_err(first, first_ref) < FP32_TOL
    assert fed == fed_ref
    assert rel_err(steps, steps_ref) < FP32_TOL


def check_bf16_against_transformers(device):
    """bf16 weights and activations: our error against transformers in fp32 (same weights,
    its greedy stream forced on both) stays within twice transformers' own bf16 error, step by
    step at worst and on average."""
    model = qw.Qwen35Model.random(qw.tiny_config(), seed=2, device=device, dtype=torch.bfloat16)
    hf = transformers_twin(model)
    hf32 = transformers_twin(qw.Qwen35Model.random(qw.tiny_config(), seed=2, device=device))
    tokens = prompt(37, model.config.vocab_size, seed=1)
    first32, steps32, fed = transformers_greedy(hf32, tokens, 64)
    first_hf, steps_hf, _ = transformers_greedy(hf, tokens, 64, forced=fed)
    first, steps, _ = ours_greedy(model, "eager-fp32", tokens, 64, forced=fed)
    assert rel_err(first, first32) <= 2 * rel_err(first_hf, first32)
    ours = torch.tensor([rel_err(a, b) for a, b in zip(steps, steps32)])
    theirs = torch.tensor([rel_err(a, b) for a, b in zip(steps_hf, steps32)])
    assert ours.max() <= 2 * theirs.max() and ours.mean() <= 2 * theirs.mean(), (ours, theirs)


def test_matches_transformers_cpu_bf16():
    check_bf16_against_transformers("cpu")


@pytest.mark.cuda
@cuda
def test_matches_transformers_cuda_bf16():
    check_bf16_against_transformers("cuda")


# ---- state modes ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    return qw.Qwen35Model.random(qw.tiny_config(), seed=3)


@pytest.fixture(scope="module")
def eager_run(tiny_model):
    """Eager fp32 over a fixed stream of 70 tokens after a 21-token prompt: the reference."""
    tokens = prompt(21, tiny_model.config.vocab_size, seed=4)
    stream = prompt(70, tiny_model.config.vocab_size, seed=5).tolist()
    return tokens, stream, ours_greedy(tiny_model, "eager-fp32", tokens, 70, forced=stream)


@pytest.mark.parametrize("mode", [m for m in StateMode.NAMES if m != "eager-fp32"] +
                         ["replay-fp32:4", "replay-fp32+bf16:4"])
def test_state_modes_match_eager_fp32(tiny_model, eager_run, mode):
    """70 steps: 4 folds at the default buffer length, 17 at L = 4."""
    tokens, stream, (first_ref, steps_ref, _) = eager_run
    first, steps, _ = ours_greedy(tiny_model, mode, tokens, 70, forced=stream)
    # Prefill loads the same fp32 scan's state in every mode.
    assert torch.equal(first, first_ref)
    assert rel_err(steps, steps_ref) < MODE_TOL[mode.split(":")[0]]


def test_replay_fp32_greedy_tokens_equal_eager_fp32_over_256_steps(tiny_model):
    tokens = prompt(9, tiny_model.config.vocab_size, seed=6)
    _, steps_e, fed_e = ours_greedy(tiny_model, "eager-fp32", tokens, 256)
    _, steps_r, fed_r = ours_greedy(tiny_model, "replay-fp32", tokens, 256)
    assert fed_r == fed_e
    assert rel_err(steps_r, steps_e) < MODE_TOL["replay-fp32"]


# ---- windows and batches ----------------------------------------------------------------------

def test_window_then_commit_equals_single_steps(tiny_model):
    """Rows of different lengths decode 4-token windows and accept a random count (0 to 4,
    a pad row beside them); the same accepted tokens stepped one by one in a second cache give
    the same logits, window after window."""
    V = tiny_model.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    spec = ServingCache(tiny_model, capacity=4, max_seq_len=256, mode="replay-fp32",
                        max_spec_tokens=4)
    single = ServingCache(tiny_model, capacity=4, max_seq_len=256, mode="replay-fp32")
    rows = []
    for n in (5, 12, 1):
        p = prompt(n, V, seed=n)
        a, b = spec.allocate(), single.allocate()
        tiny_model.prefill(spec, a, p)
        tiny_model.prefill(single, b, p)
        rows.append((a, b))
    slot_ids = torch.tensor([a for a, _ in rows] + [-1], dtype=torch.int32)
    for _ in range(12):
        window = torch.randint(0, V, (4, 4), generator=gen)
        accepted = torch.randint(0, 5, (4,), generator=gen, dtype=torch.int32)
        logits = tiny_model.decode(spec, slot_ids, window)
        tiny_model.commit(spec, slot_ids, accepted)
        for r, (_, b) in enumerate(rows):
            one = torch.tensor([b], dtype=torch.int32)
            for t in range(int(accepted[r])):
                ref = tiny_model.step(single, one, window[r, t:t + 1])[0]
                assert rel_err(logits[r, t], ref) < MODE_TOL["replay-fp32"]
    for r, (a, b) in enumerate(rows):
        assert spec.lengths[a] == single.lengths[b]


def test_rows_are_independent_of_their_batch(tiny_model):
    """Three sequences decoded greedily alone, and together with a pad row and staggered
    starts (the third joins after 10 steps): the same tokens and logits."""
    V = tiny_model.config.vocab_size
    prompts = [prompt(n, V, seed=10 + n) for n in (3, 17, 8)]
    alone = [ours_greedy(tiny_model, "replay-fp32", p, 30) for p in prompts]
    cache = ServingCache(tiny_model, capacity=4, max_seq_len=64, mode="replay-fp32")
    slots = [cache.allocate() for _ in prompts]
    nxt = [int(tiny_model.prefill(cache, s, p)[-1].argmax()) for s, p in zip(slots[:2], prompts)]
    fed = [[], [], []]
    logits = [[], [], []]
    for step in range(40):
        if step == 10:
            nxt.append(int(tiny_model.prefill(cache, slots[2], prompts[2])[-1].argmax()))
        live = [i for i in range(len(nxt)) if len(fed[i]) < 30]
        ids = torch.tensor([-1] + [slots[i] for i in live], dtype=torch.int32)
        toks = torch.tensor([0] + [nxt[i] for i in live])
        out = tiny_model.step(cache, ids, toks)
        for j, i in enumerate(live, start=1):
            fed[i].append(nxt[i])
            logits[i].append(out[j])
            nxt[i] = int(out[j].argmax())
    for i, (_, ref_logits, ref_fed) in enumerate(alone):
        assert fed[i] == ref_fed
        assert rel_err(logits[i], ref_logits) < FP32_TOL
