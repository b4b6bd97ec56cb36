"""The package's surface: the names users rely on, the type stubs against the compiled module,
the buffer list."""

import ast
import inspect
import pathlib

import replayssm
from replayssm import _C
from conftest import config


def test_public_names():
    assert set(replayssm.__all__) == {"BufferSpec", "CacheConfig", "CacheRecords", "ConvInputs",
                                      "StateCache", "cache_buffers", "cuda_available",
                                      "gdn_decode", "mamba2_decode"}
    for name in ("allocate", "free", "load_state", "export_state", "commit", "fold",
                 "materialize", "read_records", "restore", "fork", "truncate",
                 "load_conv_window", "export_conv_window"):
        assert callable(getattr(replayssm.StateCache, name))
    assert list(inspect.signature(replayssm.mamba2_decode).parameters) == [
        "cache", "layer", "slot_ids", "x", "dt", "B", "C", "A", "D", "dt_bias", "z", "out",
        "stream", "conv", "fold_every"]
    assert list(inspect.signature(replayssm.gdn_decode).parameters) == [
        "cache", "layer", "slot_ids", "q", "k", "v", "g", "beta", "scale", "qk_l2norm", "out",
        "stream", "conv", "fold_every"]


def stub_names(tree):
    """Top-level names of a .pyi and, per class, the names it defines."""
    top, classes = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            top.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    return top, classes


def test_stubs_match_the_compiled_module():
    path = pathlib.Path(replayssm.__file__).with_name("_C.pyi")
    top, classes = stub_names(ast.parse(path.read_text()))
    module = {n for n in dir(_C) if not n.startswith("__")}
    assert top == module
    for cls, methods in classes.items():
        defined = {n for n in dir(getattr(_C, cls)) if not n.startswith("_") or n == "__init__"}
        assert methods == defined, cls
    assert pathlib.Path(replayssm.__file__).with_name("py.typed").exists()


def test_buffer_list():
    cfg = config("gdn", num_layers=3, capacity=5, checkpoint="fp32+fp8", buffer_len=6,
                 max_spec_tokens=2)
    specs = {s.name: s for s in replayssm.cache_buffers(cfg)}
    assert list(specs) == ["ckpt_hi", "ckpt_lo", "ckpt_lo_scale", "ring_vec", "ring_key",
                           "ring_key_scale", "ring_write", "ring_decay", "committed", "folded",
                           "pending", "allocated"]
    ring = cfg.ring_capacity
    assert ring == 16  # next power of two >= L + 2T - 1 = 9
    assert specs["ckpt_hi"].shape == (3, 5, 4, 8, 16) and specs["ckpt_hi"].dtype == "float32"
    assert specs["ckpt_lo"].dtype == "float8_e4m3fn" and specs["ckpt_lo"].nbytes == 3 * 5 * 4 * 8 * 16
    assert specs["ring_vec"].shape == (3, 5, ring, 4, 8)
    assert specs["committed"] == ("committed", "uint32", (5,), 20, 64, 0)
    eager = config("mamba2", mode="eager", state_dtype="bfloat16")
    assert [s.name for s in replayssm.cache_buffers(eager)] == [
        "state", "committed", "folded", "pending", "allocated"]
    assert replayssm.cache_buffers(eager)[0].dtype == "bfloat16"


def test_config_normalises_dtypes():
    import numpy as np

    cfg = config("mamba2", input_dtype="bf16", state_dtype=np.float32)
    assert (cfg.input_dtype, cfg.state_dtype) == ("bfloat16", "float32")
    assert cfg.state_shape == (4, 8, 16)
    assert config("gdn").state_shape == (4, 8, 16)  # (num_v_heads, head_v_dim, head_k_dim)
    assert cfg == config("mamba2", input_dtype="bfloat16")
    assert "owning" in repr(replayssm.StateCache(cfg))


def test_readme_example_runs(capsys):
    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text()
    start = text.index("```python\n", text.index("## Python")) + len("```python\n")
    exec(compile(text[start:text.index("```", start)], str(readme), "exec"), {})
    assert capsys.readouterr().out == "(1, 1, 8, 16) (8, 16, 32)\n"
