"""The accuracy study's scripts (study/): the corpus split, a training smoke run, the KL
measure and the accuracy pipeline on a tiny random model."""

import math
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[2] / "study"
sys.path.insert(0, str(STUDY))

import corpus  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The models here are tiny: a thread pool only adds waits to every op (40x on a loaded
    2-core machine)."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)


# ---- corpus split -----------------------------------------------------------------------

def test_split_is_deterministic_disjoint_and_complete():
    paths = [f"pkg{i % 7}/module_{i}.py" for i in range(2000)]
    train, heldout = corpus.split(paths)
    assert corpus.split(list(paths)) == (train, heldout)
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(paths)
    # 5 % of 2000 files, within a generous binomial band.
    assert 60 <= len(heldout) <= 140


def test_split_depends_on_the_path_alone():
    paths = [f"lib/m{i}.py" for i in range(500)]
    _, heldout = corpus.split(paths)
    _, heldout_of_fewer = corpus.split(paths[::3])
    assert heldout_of_fewer == [p for p in paths[::3] if p in heldout]


def test_list_sources_skips_installed_packages(tmp_path):
    write_tree(tmp_path, {"a.py": b"x = 1\n", "sub/b.py": b"y = 2\n", "sub/c.txt": b"no\n",
                          "site-packages/torch/t.py": b"z\n", "dist-packages/d.py": b"w\n",
                          "__pycache__/a.py": b"q\n"})
    assert corpus.list_sources(tmp_path) == ["a.py", "sub/b.py"]


def test_make_streams_cut_the_concatenation(tmp_path):
    write_tree(tmp_path, {"a.py": b"0123456789\n", "b.py": b"abcdefghij\n"})
    streams = corpus.make_streams(tmp_path, ["a.py", "b.py"], length=8, count=2)
    assert streams == [b"01234567", b"89\nabcde"]
    with pytest.raises(ValueError, match="fewer than 3 streams of 8"):
        corpus.make_streams(tmp_path, ["a.py", "b.py"], length=8, count=3)


# ---- training ---------------------------------------------------------------------------

def small_corpus(root):
    """A corpus with held-out files: enough repetitive Python that a tiny model learns fast."""
    body = b"".join(b"def f%d(x):\n    return x + %d\n\n" % (i, i) for i in range(40))
    files = {f"m{i}.py": body for i in range(60)}
    write_tree(root, files)
    _, heldout = corpus.split(sorted(files))
    assert heldout, "the fixture needs at least one held-out file"


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_training_smoke_run_lowers_the_loss(tmp_path, monkeypatch, family):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    import train

    # The smoke size keeps the real state head sizes; this test needs only the loop.
    monkeypatch.setattr(train, "model_config", lambda family, smoke: tiny_config(family))
    small_corpus(tmp_path / "src")
    out = tmp_path / "out"
    args = train.parse_args(["--family", family, "--out", str(out), "--smoke",
                             "--corpus-root", str(tmp_path / "src"), "--device", "cpu",
                             "--lr", "3e-3", "--max-steps", "16"])
    curve = train.train(args)
    losses = [row["loss"] for row in curve["train"]]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 0.3, losses
    nats = [row["nats_per_byte"] for row in curve["heldout"]]
    assert nats[-1] < nats[0]
    assert json.loads((out / "curve.json").read_text())["steps"] == 16
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert corpus.read_list(out / "heldout.txt") == corpus.split(corpus.list_sources(tmp_path / "src"))[1]


def test_training_rejects_a_corpus_without_held_out_files(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import train

    # Pick one file name the split keeps for training.
    name = next(f"t{i}.py" for i in range(100) if not corpus.is_heldout(f"t{i}.py"))
    write_tree(tmp_path / "src", {name: b"x = 1\n" * 100})
    args = train.parse_args(["--family", "qwen3_5", "--out", str(tmp_path / "out"), "--smoke",
                             "--corpus-root", str(tmp_path / "src"), "--device", "cpu"])
    with pytest.raises(ValueError, match="0 held-out files"):
        train.train(args)
    assert not (tmp_path / "out").exists()


# ---- accuracy measures ----------------------------------------------------------------------

def test_kl_is_zero_for_identical_distributions_and_matches_the_formula():
    torch = pytest.importorskip("torch")
    import accuracy

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3, 11, generator=gen) * 3
    b = torch.randn(5, 3, 11, generator=gen) * 3
    assert accuracy.kl_divergence(a, a).abs().max().item() == 0.0
    # Shifting logits leaves the distribution, and so the KL, unchanged.
    assert accuracy.kl_divergence(a, a + 7.0).max().item() < 1e-12
    p = torch.softmax(a.double(), -1)
    q = torch.softmax(b.double(), -1)
    direct = (p * torch.log(p / q)).sum(-1)
    got = accuracy.kl_divergence(a, b)
    assert got.shape == (5, 3) and got.dtype == torch.float64
    assert torch.allclose(got, direct, rtol=1e-10, atol=1e-12)
    assert (got > 0).all()


def test_first_divergence_and_binned_mean():
    torch = pytest.importorskip("torch")
    import accuracy

    ref = torch.tensor([[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]])
    other = ref.clone()
    other[2, 0] = 9
    other[0, 1] = 9
    other[3, 1] = 9
    assert accuracy.first_divergence(ref, other) == [2, 0, 4]
    values = torch.arange(10, dtype=torch.float64)[:, None].repeat(1, 2)
    assert accuracy.binned_mean(values, 4) == [1.5, 5.5, 8.5]
    assert accuracy.by_phase(values, 4) == [4.0, 5.0, 4.0, 5.0]


def test_float64_everywhere_raises_float32_casts():
    torch = pytest.importorskip("torch")
    import accuracy

    x = torch.tensor([1.0, 2.0], dtype=torch.float64) / 3
    mode = accuracy.Float64Everywhere()
    with mode:
        casts = [x.float(), x.to(torch.float32), x.to(dtype=torch.float32),
                 torch.zeros(2, dtype=torch.float32), torch.arange(3).float()]
    assert [c.dtype for c in casts] == [torch.float64] * 5
    assert casts[0][0].item() == x[0].item()
    assert mode.float32_results == 0
    with mode:
        torch.ones(2)  # the default dtype is not a cast: counted, not raised
    assert mode.float32_results == 1


# ---- the accuracy pipeline on a tiny model --------------------------------------------------

def tiny_config(family):
    """A transformers config with small state sizes, so CPU runs take seconds."""
    transformers = pytest.importorskip("transformers")
    none = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if family == "nemotron_h":
        return transformers.NemotronHConfig(
            vocab_size=256, hidden_size=32, layers_block_type=["mamba", "attention", "mlp", "mamba"],
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
            mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8,
            use_mamba_kernels=False, **none)
    return transformers.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=1, linear_num_value_heads=2, **none)


def tiny_hf_model(family, path):
    """A tiny transformers model with peaked next-byte distributions, saved as a model
    directory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cls = {"nemotron_h": transformers.NemotronHForCausalLM,
           "qwen3_5": transformers.Qwen3_5ForCausalLM}[family]
    config = tiny_config(family)
    model = cls(config)
    with torch.no_grad():
        # Let the state mixers' outputs dominate the residual stream, so the state's rounding
        # shows in the logits well above float32 rounding.
        for name, p in model.named_parameters():
            if name.endswith(("mixer.in_proj.weight", "linear_attn.in_proj_qkv.weight",
                              "linear_attn.out_proj.weight")):
                p.mul_(30.0)
            if name.endswith("linear_attn.A_log"):
                # Slow decay (about 0.97 a token), so the state carries history.
                p.fill_(math.log(0.05))
        model.lm_head.weight.mul_(10.0)
    model.save_pretrained(path)
    return config.model_type


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_accuracy_pipeline_on_a_tiny_model(tmp_path, family):
    torch = pytest.importorskip("torch")
    import accuracy
    from replayssm import models

    model_dir = tmp_path / family
    model_type = tiny_hf_model(family, model_dir)
    if model_type not in models.FAMILIES:
        pytest.skip(f"replayssm.models does not serve {model_type} yet")
    small_corpus(tmp_path / "src")
    _, heldout = corpus.split(corpus.list_sources(tmp_path / "src"))
    corpus.write_list(model_dir / "heldout.txt", heldout)
    out = tmp_path / "acc.json"
    args = accuracy.parse_args([
        "--model", str(model_dir), "--out", str(out), "--corpus-root", str(tmp_path / "src"),
        "--device", "cpu", "--length", "40", "--streams", "2", "--prompt-len", "8",
        "--gen-tokens", "12", "--bin-size", "16",
        "--modes", "eager-bf16,replay-fp32,replay-fp32+bf16:8"])
    results = accuracy.run(args)
    (res,) = results["models"]
    assert list(res["modes"]) == ["eager-bf16", "replay-fp32", "replay-fp32+bf16:8"]
    for entry in res["modes"].values():
        assert len(entry["kl"]["by_bin"]) == 3
        assert len(entry["divergence"]) == 2
        assert all(0 <= d <= 12 for d in entry["divergence"])
        assert math.isfinite(entry["nats_per_byte"])
    # Replay with an fp32 checkpoint is the eager fp32 recurrence up to float rounding; a bf16
    # state is visibly further off.
    replay = res["modes"]["replay-fp32"]["kl"]
    eager_bf16 = res["modes"]["eager-bf16"]["kl"]
    assert replay["max"] < 1e-9, replay
    assert eager_bf16["mean"] > 100 * max(replay["mean"], 1e-15), (eager_bf16, replay)
    assert res["modes"]["replay-fp32"]["divergence"] == [12, 12]
    assert len(res["modes"]["replay-fp32+bf16:8"]["kl_by_phase"]) == 8
    assert "kl_by_phase" not in res["modes"]["eager-bf16"]
    # Our fp32 model against transformers' in float64: rounding apart, the same model.
    assert res["float64"]["float32_results"] == 0
    assert res["float64"]["kl_reference_vs_float64"]["max"] < 1e-10
    assert out.exists() and out.with_suffix(".md").exists()
    assert "replay-fp32+bf16:8" in out.with_suffix(".md").read_text()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    (png,) = accuracy.plot(out)
    assert png.name == f"acc_{family}.png" and png.stat().st_size > 0


def test_accuracy_records_a_failing_model_and_runs_the_next(tmp_path, capsys):
    pytest.importorskip("torch")
    import accuracy

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "heldout.txt").write_text("missing.py\n")
    args = accuracy.parse_args(["--model", str(broken), "--model", str(broken), "--device", "cpu",
                                "--corpus-root", str(tmp_path), "--out", str(tmp_path / "a.json"),
                                "--modes", "replay-fp32"])
    results = accuracy.run(args)
    assert [r["error"].split(":")[0] for r in results["models"]] == ["FileNotFoundError"] * 2
    assert "1 held-out files" in results["models"][0]["error"]
    assert "failed: FileNotFoundError" in (tmp_path / "a.md").read_text()


def test_accuracy_budget_skips_only_explicit_buffer_lengths(tmp_path):
    pytest.importorskip("torch")
    import accuracy

    model_dir = tmp_path / "nemotron_h"
    tiny_hf_model("nemotron_h", model_dir)
    small_corpus(tmp_path / "src")
    corpus.write_list(model_dir / "heldout.txt",
                      corpus.split(corpus.list_sources(tmp_path / "src"))[1])
    args = accuracy.parse_args([
        "--model", str(model_dir), "--corpus-root", str(tmp_path / "src"), "--device", "cpu",
        "--length", "16", "--streams", "1", "--prompt-len", "4", "--gen-tokens", "4",
        "--float64-streams", "0", "--budget-s", "1e-6",
        "--modes", "replay-fp32:8,eager-bf16,replay-fp32+bf16:32"])
    (res,) = accuracy.run(args)["models"]
    assert list(res["modes"]) == ["eager-bf16"]
    assert res["skipped"] == ["replay-fp32:8", "replay-fp32+bf16:32"]
    assert "float64" not in res


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_graph_replayed_steps_equal_eager_steps(tmp_path, family):
    """The study's CUDA-graph decoding is the eager decoding, teacher-forced and free-running:
    the graph replays the same kernels on the same buffers (a tolerance, not bit equality, in
    case cuBLAS picks another algorithm under capture)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import accuracy
    from replayssm import models

    tiny_hf_model(family, tmp_path / family)
    model = models.load(str(tmp_path / family), device="cuda", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (3, 48), generator=gen).cuda()
    with torch.no_grad():
        for mode in ("eager-fp32", "replay-fp32+bf16:8"):
            eager = accuracy.teacher_forced(model, mode, tokens, use_graph=False)
            graphed = accuracy.teacher_forced(model, mode, tokens, use_graph=True)
            torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5, msg=mode)
            eager = accuracy.free_running(model, mode, tokens[:, :8], 16, use_graph=False)
            graphed = accuracy.free_running(model, mode, tokens[:, :8], 16, use_graph=True)
            assert torch.equal(eager, graphed), mode
