"""Greedy speculative decoding (replayssm.models.speculative) on tiny models of both families:
the tokens equal plain greedy decoding (the engine's one-token steps) for the n-gram drafter,
a draft model and forced acceptance patterns (every draft right, none, a random prefix per row
and step), in replay-fp32 (replay verify) and eager-fp32 (per-draft state copies); the
n-gram drafter's proposals on known histories; refusals; a CPU smoke run of bench_spec."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from replayssm.models import ServingCache  # noqa: E402
from replayssm.models import qwen3_5 as qw  # noqa: E402
from replayssm.models.engine import Engine  # noqa: E402
from replayssm.models.nemotron_h import NemotronHConfig, NemotronHModel  # noqa: E402
from replayssm.models.speculative import (DraftContext, DraftModelDrafter, Drafter,  # noqa: E402
                                          NgramDrafter, SpeculativeDecoder)

from models_util import one_cpu_thread  # noqa: E402,F401  (autouse)
from models_util import perturbed, tiny  # noqa: E402

T = 4
NEW_TOKENS = 40
MAX_SEQ = 128
MODES = ["replay-fp32", "eager-fp32"]


def prompts(vocab, device="cpu"):
    """Three prompts; the first repeats a motif, so the n-gram drafter has something to find."""
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(0, vocab, (6,), generator=g)
    return [t.to(device) for t in (motif.repeat(4)[:21], torch.randint(0, vocab, (5,), generator=g),
                                   torch.randint(0, vocab, (13,), generator=g))]


def plain_tokens(model, ps, n):
    """Plain greedy decoding: the engine's one-token steps, eager fp32, one bucket."""
    engine = Engine(model, ServingCache(model, len(ps), MAX_SEQ, "eager-fp32"),
                    buckets=(len(ps),))
    requests = [engine.submit(p, n) for p in ps]
    engine.run()
    return [r.tokens for r in requests]


class ForcedDrafter(Drafter):
    """Proposes the reference continuation with each draft right or wrong by ``pattern``:
    "all", "none", or "random" (each draft right with probability 0.6, so a wrong draft may be
    followed by right ones, which must not count); remembers the accepted counts that must
    follow (1 + the leading right drafts)."""

    def __init__(self, reference, pattern, vocab, seed=0):
        self.reference, self.pattern, self.vocab = reference, pattern, vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.expected = []

    def propose(self, ctx, n):
        B = ctx.rows.shape[0]
        pos = (ctx.lengths[:, None] + 1 + torch.arange(n, device=ctx.rows.device))
        right = self.reference[ctx.rows[:, None], pos]
        if self.pattern == "random":
            ok = torch.rand(B, n, generator=self.gen) < 0.6
        else:
            ok = torch.full((B, n), self.pattern == "all")
        self.expected.append(ok.int().cumprod(1).sum(1) + 1)
        return torch.where(ok.to(right.device), right, (right + 1) % self.vocab)


def reference_table(ps, tokens, capacity=3):
    """Each slot's prompt + plain tokens at their positions (slots are allocated in order)."""
    table = torch.zeros(capacity + 1, MAX_SEQ, dtype=torch.long, device=ps[0].device)
    for slot, (p, t) in enumerate(zip(ps, tokens)):
        row = torch.cat([p.cpu(), torch.tensor(t)])
        table[slot, :row.numel()] = row.to(table.device)
    return table


def decoder(model, mode, drafter, capacity=3, window=T):
    cache = ServingCache(model, capacity, MAX_SEQ, mode, max_spec_tokens=window)
    return SpeculativeDecoder(model, cache, drafter, window)


# ---- equivalence with plain decoding ----------------------------------------------------------

FAMILIES = ["nemotron_h", "qwen3_5"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request):
    torch.set_num_threads(1)  # as one_cpu_thread, which a module fixture runs before
    model = tiny(request.param)
    ps = prompts(model.config.vocab_size)
    # Past NEW_TOKENS by a window: the forced drafters read the continuation a step ahead.
    return request.param, model, ps, plain_tokens(model, ps, NEW_TOKENS + 8)


@pytest.mark.parametrize("mode", MODES)
def test_ngram_drafter_gives_the_plain_tokens(family_case, mode):
    family, model, ps, ref = family_case
    result = decoder(model, mode, NgramDrafter()).generate(ps, NEW_TOKENS)
    assert result.tokens == [r[:NEW_TOKENS] for r in ref]
    # The repeated motif is found: some step accepts drafts.
    assert sum(result.accepted_counts()[1:]) > 0


@pytest.mark.parametrize("draft_mode", ["replay-fp32", "eager-fp32"])
@pytest.mark.parametrize("mode", MODES)
def test_draft_model_gives_the_plain_tokens(family_case, mode, draft_mode):
    family, model, ps, ref = family_case
    draft = perturbed(family, model)
    drafter = DraftModelDrafter(draft, ServingCache(draft, 3, MAX_SEQ, draft_mode,
                                                    max_spec_tokens=T))
    result = decoder(model, mode, drafter).generate(ps, NEW_TOKENS)
    assert result.tokens == [r[:NEW_TOKENS] for r in ref]
    counts = result.accepted_counts()
    assert counts[-1] > 0 and sum(counts[:-1]) > 0, counts  # full windows and rejections
    assert drafter.cache.ssm.free_slots == 3  # generate freed the draft's slots too


def test_a_smaller_draft_model_gives_the_plain_tokens(family_case):
    """A draft of fewer layers and another seed: it rarely agrees, every draft is verified."""
    family, model, ps, ref = family_case
    if family == "nemotron_h":
        draft = NemotronHModel.random(NemotronHConfig.tiny(pattern="M*-"), seed=2)
    else:
        draft = qw.Qwen35Model.random(qw.tiny_config(num_hidden_layers=2,
                                                     layer_types=(qw.LINEAR, qw.FULL)), seed=2)
    drafter = DraftModelDrafter(draft, ServingCache(draft, 3, MAX_SEQ, "replay-fp32",
                                                    max_spec_tokens=T))
    result = decoder(model, "replay-fp32", drafter).generate(ps, NEW_TOKENS)
    assert result.tokens == [r[:NEW_TOKENS] for r in ref]


@pytest.mark.parametrize("mode", MODES)
def test_the_target_as_its_own_draft_model_fills_every_window(family_case, mode):
    """The draft cache stays in step with the target's: a draft model equal to the target
    proposes exactly the target's tokens, so every step accepts the whole window."""
    family, model, ps, ref = family_case
    drafter = DraftModelDrafter(model, ServingCache(model, 3, MAX_SEQ, mode, max_spec_tokens=T))
    result = decoder(model, mode, drafter).generate(ps, NEW_TOKENS)
    assert result.tokens == [r[:NEW_TOKENS] for r in ref]
    assert result.accepted_counts()[:-1] == [0] * (T - 1)


@pytest.mark.parametrize("pattern", ["all", "none", "random"])
@pytest.mark.parametrize("mode", MODES)
def test_forced_acceptance_patterns_give_the_plain_tokens(family_case, mode, pattern):
    family, model, ps, ref = family_case
    drafter = ForcedDrafter(reference_table(ps, ref), pattern, model.config.vocab_size)
    spec = decoder(model, mode, drafter)
    result = spec.generate(ps, NEW_TOKENS)
    assert result.tokens == [r[:NEW_TOKENS] for r in ref]
    expected = torch.stack(drafter.expected).int()
    live = result.accepted > 0
    assert torch.equal(result.accepted[live], expected[live])
    if pattern == "random":  # rows of one step accepted different counts
        assert any(len(set(row[live[i]].tolist())) > 1 for i, row in enumerate(result.accepted))


@pytest.mark.parametrize("window", [1, 2, 8])
def test_any_window_gives_the_plain_tokens(family_case, window):
    family, model, ps, ref = family_case
    drafter = ForcedDrafter(reference_table(ps, ref), "random", model.config.vocab_size,
                            seed=window)
    spec = decoder(model, "replay-fp32", drafter, window=window)
    assert spec.generate(ps, NEW_TOKENS).tokens == [r[:NEW_TOKENS] for r in ref]


# ---- the n-gram drafter -----------------------------------------------------------------------

def ngram_drafts(stream, n, **kw):
    """NgramDrafter's n drafts for one row whose tokens are ``stream`` (the last one pending)."""
    history = torch.zeros(2, 64, dtype=torch.long)
    history[0, :len(stream)] = torch.tensor(stream)
    ctx = DraftContext(torch.tensor([0], dtype=torch.int32), torch.tensor([0]),
                       torch.tensor([len(stream) - 1]), history)
    return NgramDrafter(**kw).propose(ctx, n)[0].tolist()


def test_ngram_drafter_continues_the_latest_longest_match():
    # "1 2 3" occurs twice before the suffix; the latest occurrence is followed by 7 8.
    assert ngram_drafts([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 1, 2, 3], 2) == [7, 8]
    # The trigram "5 1 2" beats the later bigram "1 2" (followed by 3 here, 6 there).
    assert ngram_drafts([5, 1, 2, 6, 0, 1, 2, 3, 9, 5, 1, 2], 1) == [6]
    # A continuation that reaches the pending token repeats the matched period.
    assert ngram_drafts([4, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    # No match: the pending token again.
    assert ngram_drafts([1, 2, 3, 4], 3) == [4, 4, 4]
    # lookback: the match at the start is out of reach of the last 4 positions.
    assert ngram_drafts([7, 9, 0, 0, 0, 0, 0, 0, 5, 7], 1, lookback=4, min_ngram=1) == [7]
    assert ngram_drafts([7, 9, 0, 0, 0, 0, 0, 0, 5, 7], 1, lookback=None) == [9]


def test_ngram_drafter_rows_are_independent():
    history = torch.zeros(3, 32, dtype=torch.long)
    history[0, :6] = torch.tensor([3, 4, 5, 3, 4, 9])
    history[1, :4] = torch.tensor([8, 8, 8, 8])
    ctx = DraftContext(torch.tensor([0, 1, -1], dtype=torch.int32), torch.tensor([0, 1, 2]),
                       torch.tensor([4, 3, 0]), history)
    assert NgramDrafter().propose(ctx, 2).tolist() == [[5, 3], [8, 8], [0, 0]]


# ---- refusals ---------------------------------------------------------------------------------

def test_refusals_leave_the_caches_untouched():
    model = tiny("nemotron_h")
    cache = ServingCache(model, 2, 32, "replay-fp32", max_spec_tokens=2)
    with pytest.raises(ValueError, match="max_spec_tokens"):
        SpeculativeDecoder(model, cache, NgramDrafter(), 3)
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeDecoder(model, cache, None, 2)
    small = ServingCache(model, 1, 32, "replay-fp32", max_spec_tokens=2)
    with pytest.raises(ValueError, match="capacity"):
        SpeculativeDecoder(model, cache, DraftModelDrafter(model, small), 2)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=1, min_ngram=2)
    spec = SpeculativeDecoder(model, cache, NgramDrafter(), 2)
    with pytest.raises(ValueError, match="max_seq_len"):
        spec.generate([torch.zeros(20, dtype=torch.long)], 12)
    with pytest.raises(ValueError, match="prompt"):
        spec.admit(torch.zeros(31, dtype=torch.long))
    assert cache.ssm.free_slots == 2 and int(cache.lengths.sum()) == 0


# ---- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_steps_give_the_plain_tokens(family, mode):
    """fp32 on the GPU, the speculative step captured in a CUDA graph (n-gram and draft model)
    against plain decoding there."""
    model = tiny(family, "cuda")
    ps = prompts(model.config.vocab_size, "cuda")
    ref = plain_tokens(model, ps, NEW_TOKENS)
    assert decoder(model, mode, NgramDrafter()).generate(ps, NEW_TOKENS).tokens == ref
    draft = perturbed(family, model)
    drafter = DraftModelDrafter(draft, ServingCache(draft, 3, MAX_SEQ, mode, max_spec_tokens=T))
    assert decoder(model, mode, drafter).generate(ps, NEW_TOKENS).tokens == ref


# ---- the benchmark ------------------------------------------------------------------------------

def test_bench_spec_smoke(tmp_path):
    out = tmp_path / "spec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "replayssm.bench_spec", "--layouts", "nemotron-tiny",
         "qwen3.5-tiny", "--batches", "2", "--steps", "2", "--repeats", "1", "--context", "16",
         "--device", "cpu", "--dtype", "float32", "--profile-batches", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    kinds = {(r["layout"], r["method"]) for r in runs}
    assert kinds == {(l, m) for l in ("nemotron-tiny", "qwen3.5-tiny")
                     for m in ("replay-verify", "per-draft-state", "plain")}
    for r in runs:
        assert r["ms_per_step"] > 0 and r["accepted_tokens_per_s"] > 0
        assert 1 <= r["mean_accepted"] <= r["window"]
        assert r["max_requests"] >= 1
        ratio = r["accepted_tokens_per_s"] / next(
            b["accepted_tokens_per_s"] for b in runs
            if b["layout"] == r["layout"] and b["method"] == "per-draft-state")
        assert r["speedup_vs_per_draft_state"] == pytest.approx(ratio)
        # --profile-batches: the step's breakdown (on the CPU, by operator), shares summing to 1
        assert sum(r["breakdown"].values()) == pytest.approx(1.0)
        assert r["profiled_ms_per_step"] > 0 and r["top_kernels"]
    assert "vs draft-state" in proc.stdout
    assert "top kernels: qwen3.5-tiny batch 2 replay-verify" in proc.stdout
    # Each family verifies with its own default replay mode.
    assert {r["layout"]: r["mode"] for r in runs if r["method"] == "replay-verify"} == {
        "nemotron-tiny": "replay-fp32+bf16:8", "qwen3.5-tiny": "replay-fp32+bf16:8"}


def test_bench_spec_replay_modes_per_layout():
    from replayssm import bench_spec

    layouts = ["nemotron-nano-4b", "qwen3.5-4b"]
    assert bench_spec.replay_modes(None, layouts) == {
        "nemotron-nano-4b": "replay-fp32+bf16:8", "qwen3.5-4b": "replay-fp32+bf16:8"}
    assert bench_spec.replay_modes(["replay-bf16", "qwen3.5-4b=replay-fp32+fp8:16"], layouts) == {
        "nemotron-nano-4b": "replay-bf16", "qwen3.5-4b": "replay-fp32+fp8:16"}
    for bad in (["eager-fp32"], ["qwen3.5-tiny=replay-fp32"], ["replay-fp64"]):
        with pytest.raises(ValueError):
            bench_spec.replay_modes(bad, layouts)
    with pytest.raises(SystemExit):  # the command line refuses them with its usage
        bench_spec.parse_args(["--replay-mode", "nemotron-nano-4b=eager-fp32"])


def test_bench_spec_measures_the_acceptance_of_a_trained_model(tmp_path):
    """--measure on the study's trained Nemotron-H over stand-ins for two of its held-out files
    (this machine's library may lack them): the counts cover every row-step, T entries."""
    from replayssm import bench_spec

    model_dir = Path(__file__).resolve().parents[2] / "study" / "models" / "nemotron_h"
    if not (model_dir / "model.safetensors").is_file():
        pytest.skip("no study/models/nemotron_h in this tree")
    names = (model_dir / "heldout.txt").read_text().split()[:2]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"def f(x):\n    return x + 1\n\n" * 4)
    out = bench_spec.measure(str(model_dir), [3], str(tmp_path), prompt_bytes=64, new_tokens=12)
    assert out["files"] == names
    w = out["windows"][3]
    assert len(w["counts"]) == 3 and sum(w["fractions"]) == pytest.approx(1)
    assert w["steps"] <= sum(w["counts"]) <= 2 * w["steps"]
    with pytest.raises(ValueError, match="held-out files"):
        bench_spec.measure(str(model_dir), [3], str(tmp_path / "none"), 64, 12)
