"""The engine (continuous batching) on a tiny Nemotron-H model: a request's tokens do not depend
on the requests sharing its batch; requests are admitted and finish mid-run, in reused slots;
the tokens are the greedy continuation model.prefill/model.step give. CUDA: graphs vs plain
calls. And the end-to-end benchmark's code path at a tiny layout."""

import json

import pytest

torch = pytest.importorskip("torch")

from replayssm.models import ServingCache  # noqa: E402
from replayssm.models import nemotron_h  # noqa: E402
from replayssm.models.engine import Engine  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Replay folds every 4 tokens here, so a request's folds land on many steps, and on different
# steps from its neighbours' (they start at other steps): the staggered case.
MODES = ["eager-fp32", "replay-fp32:4"]


@pytest.fixture(scope="module")
def model():
    return nemotron_h.NemotronHModel.random(nemotron_h.NemotronHConfig.tiny(), seed=3)


def prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g)


def engine(model, mode, capacity=4, buckets=(4,), device="cpu", **kw):
    cache = ServingCache(model, capacity=capacity, max_seq_len=64, mode=mode)
    return Engine(model, cache, buckets=buckets, **kw)


def greedy(model, mode, tokens, max_new, batch):
    """The greedy continuation by direct model calls, the row padded to `batch` with pad rows
    (the engine's bucket): what the engine must reproduce bit for bit."""
    cache = ServingCache(model, capacity=batch, max_seq_len=64, mode=mode)
    slot = cache.allocate()
    out = [int(model.prefill(cache, slot, tokens)[-1].argmax())]
    slot_ids = torch.full((batch,), -1, dtype=torch.int32)
    slot_ids[batch - 1] = slot  # another row position than the engine's row 0
    while len(out) < max_new:
        step_tokens = torch.zeros(batch, dtype=torch.int64)
        step_tokens[batch - 1] = out[-1]
        out.append(int(model.step(cache, slot_ids, step_tokens)[batch - 1].argmax()))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_request_alone_and_in_a_staggered_batch_give_the_same_tokens(model, mode):
    target = prompt(0, 9)
    alone = engine(model, mode)
    request = alone.submit(target, 24)
    alone.run()
    assert request.tokens == greedy(model, mode, target, 24, batch=4)

    busy = engine(model, mode)
    others = [busy.submit(prompt(1, 5), 30)]
    for _ in range(3):
        busy.step()
    mine = busy.submit(target, 24)
    busy.step()
    others.append(busy.submit(prompt(2, 13), 6))   # finishes while `mine` runs
    for _ in range(2):
        busy.step()
    others.append(busy.submit(prompt(3, 3), 40))   # outlives it
    others.append(busy.submit(prompt(4, 7), 12))
    busy.run()
    assert mine.tokens == request.tokens
    # It shared its steps with every other request, at other fold phases.
    for other in others:
        assert other.admitted_step < mine.finished_step and mine.admitted_step < other.finished_step
    assert len({r.admitted_step % 4 for r in others + [mine]}) > 1


def test_requests_come_and_go_in_reused_slots(model):
    mode = "replay-fp32:4"
    eng = engine(model, mode, capacity=2, buckets=(2,))
    specs = [(10, 5, 7), (11, 8, 3), (12, 2, 9), (13, 6, 1), (14, 4, 5)]  # seed, length, new
    requests = [eng.submit(prompt(seed, n), new) for seed, n, new in specs]
    slots_seen = set()
    order = []
    while eng.pending:
        assert len(eng.active) <= 2
        slots_seen.update(r.slot for r in eng.active)
        order.extend(r.id for r in eng.step())
    assert slots_seen == {0, 1}, "five requests must reuse the two slots"
    assert sorted(order) == [r.id for r in requests]
    assert eng.cache.ssm.free_slots == 2
    for r, (seed, n, new) in zip(requests, specs):
        assert r.done and len(r.tokens) == new
        assert r.tokens == greedy(model, mode, prompt(seed, n), new, batch=2), r.id
    # The third request waited for a free slot; the one-token request finished on admission.
    assert requests[2].admitted_step > 0
    assert requests[3].finished_step == requests[3].admitted_step


def test_buckets_follow_the_active_rows(model):
    eng = engine(model, "eager-fp32", capacity=5, buckets=(1, 2, 4))
    assert eng.buckets == [1, 2, 4, 5]  # capacity 5 needs a bucket of 5
    for i in range(5):
        eng.submit(prompt(20 + i, 3), 3 + i)
    eng.step()
    assert eng._runner.batch == 5
    eng.run()
    assert sorted(eng._runners) == [1, 2, 4, 5]


@pytest.mark.parametrize("args, message", [
    (([], 4), "non-empty 1-D"),
    (([[1, 2]], 4), "non-empty 1-D"),
    (([0.5, 1.0], 4), "token ids"),
    (([1, 2], 0), "max_new_tokens must be positive"),
    ((list(range(60)), 5), "exceed the cache's max_seq_len"),
])
def test_bad_requests_are_refused(model, args, message):
    eng = engine(model, "eager-fp32")
    eng.submit(prompt(5, 4), 2)
    with pytest.raises(ValueError, match=message):
        eng.submit(*args)
    assert eng.pending == 1
    assert eng.run()[0].tokens is not None


def test_run_refuses_to_wait_for_slots_held_elsewhere(model):
    eng = engine(model, "eager-fp32", capacity=1)
    held = eng.cache.allocate()
    eng.submit(prompt(6, 4), 2)
    with pytest.raises(RuntimeError, match="no free slot"):
        eng.run()
    eng.cache.free(held)
    assert len(eng.run()) == 1


def test_bucket_list_is_checked(model):
    with pytest.raises(ValueError, match="positive batch sizes"):
        engine(model, "eager-fp32", buckets=(0, 4))


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["eager-fp32", "replay-fp32", "replay-fp32+bf16"])
def test_cuda_graphs_give_the_same_tokens_as_plain_calls(mode):
    gpu_model = nemotron_h.NemotronHModel.random(nemotron_h.NemotronHConfig.tiny(), seed=3,
                                                 device="cuda", dtype=torch.bfloat16)
    results = []
    for graphs in (False, True):
        cache = ServingCache(gpu_model, capacity=8, max_seq_len=128, mode=mode)
        eng = Engine(gpu_model, cache, buckets=(2, 4, 8), cuda_graphs=graphs)
        requests = [eng.submit(prompt(30 + i, 4 + 3 * i), 20 + 7 * i) for i in range(3)]
        for _ in range(5):
            eng.step()
        requests += [eng.submit(prompt(40 + i, 6), 15) for i in range(4)]
        eng.run()
        assert graphs == all(r.graph is not None for r in eng._runners.values())
        results.append([r.tokens for r in requests])
    assert results[0] == results[1]


# ---- the benchmark's code path ------------------------------------------------------------------

def test_bench_e2e_sets_and_records_the_fold_cadence(tmp_path):
    """--fold-every reaches the replay modes' caches (each row records its cadence; eager
    modes keep theirs), and a value that is no cadence is refused by name."""
    from replayssm import bench_e2e

    out = tmp_path / "bench.json"
    bench_e2e.main(["--layouts", "qwen3.5-tiny", "--modes", "eager-fp32", "replay-fp32:4",
                    "--batches", "2", "--context", "8", "--steps", "4", "--repeats", "1",
                    "--device", "cpu", "--dtype", "float32", "--starts", "staggered",
                    "--profile-starts", "--fold-every", "2", "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert {r["mode"]: r["fold_every"] for r in runs} == {"eager-fp32": 0, "replay-fp32:4": 2}
    with pytest.raises(SystemExit):
        bench_e2e.main(["--fold-every", "soon"])


def test_bench_e2e_runs_at_a_tiny_layout(tmp_path):
    from replayssm import bench_e2e

    out = tmp_path / "bench.json"
    layouts = ("nemotron-tiny", "qwen3.5-tiny", "nemotron-moe-tiny", "qwen3.5-moe-tiny")
    bench_e2e.main(["--layouts", *layouts, "--modes", "eager-fp32",
                    "replay-fp32+bf16:4", "--batches", "2", "--context", "24", "--steps", "4",
                    "--repeats", "1", "--device", "cpu", "--dtype", "float32",
                    "--profile-starts", "synchronized", "staggered",
                    "--json", str(out)])
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert {(r["layout"], r["mode"], r["starts"]) for r in runs} == {
        (layout, mode, starts) for layout in layouts
        for mode in ("eager-fp32", "replay-fp32+bf16:4") for starts in ("synchronized", "staggered")}
    for r in runs:
        assert r["batch"] == 2 and r["ms_per_step"] > 0 and r["tokens_per_s"] > 0
        shares = r["breakdown"]
        assert set(shares) == {"ssm", "attention", "gemm", "other"}
        assert abs(sum(shares.values()) - 1) < 1e-6
        assert shares["ssm"] > 0 and shares["gemm"] > 0
        top = r["top_kernels"]
        assert 0 < len(top) <= bench_e2e.TOP_KERNELS
        assert all(k["calls_per_step"] > 0 and k["us_per_step"] >= 0 for k in top)
        assert [k["us_per_step"] for k in top] == sorted((k["us_per_step"] for k in top),
                                                         reverse=True)
        assert sum(k["us_per_step"] for k in top) <= r["profiled_ms_per_step"] * 1e3 * (1 + 1e-6)
        if r["mode"] != "eager-fp32":
            assert r["speedup_vs_eager_fp32"] == pytest.approx(
                next(e["ms_per_step"] for e in runs if e["mode"] == "eager-fp32"
                     and e["layout"] == r["layout"] and e["starts"] == r["starts"])
                / r["ms_per_step"])
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert bench_e2e.main(["--plot", str(out), "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_bench_profiles_the_largest_batch_by_default():
    from replayssm import bench_e2e

    args = bench_e2e.parse_args(["--batches", "1", "16", "4"])
    assert args.profile_batches == [16] and args.profile_starts == ["staggered"]
    args = bench_e2e.parse_args(["--batches", "1", "16", "--profile-all"])
    assert args.profile_batches == [1, 16] and args.profile_starts == list(bench_e2e.STARTS)


@pytest.mark.parametrize("module", ["bench_e2e", "bench_spec"])
def test_benches_refuse_a_profile_batch_that_does_not_run(module, capsys):
    import importlib

    bench = importlib.import_module(f"replayssm.{module}")
    with pytest.raises(SystemExit):
        bench.parse_args(["--batches", "1", "16", "--profile-batches", "16", "64",
                          "--device", "cpu"])
    assert "--profile-batches 64: not among --batches 1 16" in capsys.readouterr().err
    assert bench.parse_args(["--batches", "1", "16", "--profile-batches", "16",
                             "--device", "cpu"]).profile_batches == [16]


@pytest.mark.parametrize("name, cls", [
    ("void replayssm::cuda::mamba2::(anonymous namespace)::replay_kernel<(replayssm::"
     "CheckpointPrecision)1>(replayssm::cuda::mamba2::Params)", "ssm"),
    ("void replayssm::cuda::(anonymous namespace)::commit_kernel(replayssm::cuda::CommitParams)",
     "ssm"),
    ("_attention_kernel", "attention"),
    ("_combine_kernel", "attention"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>",
     "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>",
     "other"),
])
def test_kernels_are_classed_by_name(name, cls):
    from replayssm import bench_e2e

    assert bench_e2e.kernel_class(name) == cls


@pytest.mark.parametrize("mode", ["eager-fp32", "eager-bf16", "replay-fp32+bf16:4",
                                  "replay-fp32+fp8:4", "replay-bf16:4"])
def test_bench_fills_ssm_state_as_load_state_per_slot_does(model, mode):
    """The benchmark's bulk fill leaves every buffer byte of every slot as one load_state per
    slot and layer would (both fresh caches, the same states)."""
    import replayssm
    from replayssm import bench_e2e

    caches = [ServingCache(model, capacity=5, max_seq_len=8, mode=mode) for _ in range(2)]
    slots = [[c.allocate() for _ in range(4)] for c in caches]
    bench_e2e.fill_ssm_state(caches[0].ssm, slots[0], torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(7)
    ssm = caches[1].ssm
    states = [0.1 * torch.randn(ssm.config.state_shape, generator=gen)
              for _ in range(ssm.config.num_layers)]
    for layer, state in enumerate(states):
        for slot in slots[1]:
            ssm.load_state(layer, slot, state)
    for spec in replayssm.cache_buffers(ssm.config):
        a, b = (c.ssm.buffers[spec.name].view(torch.uint8) for c in caches)
        assert torch.equal(a, b), spec.name
    for layer, state in enumerate(states):
        for slot in slots[0]:
            torch.testing.assert_close(caches[0].ssm.export_state(layer, slot), state,
                                       atol=0.02, rtol=0.02)
