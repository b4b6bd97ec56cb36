"""The accuracy study's scripts (study/): the corpus split, a training smoke run, the KL
measure and the accuracy pipeline on a tiny random model."""

import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[2] / "study"
sys.path.insert(0, str(STUDY))

import corpus  # noqa: E402


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
def test_training_smoke_run_lowers_the_loss(tmp_path, family):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    import train

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
