"""Helpers shared by the model families' tests (replayssm.models): where and in which dtype a
test runs, the tolerance of each state mode, tiny models and draft models, relative errors,
single-threaded CPU runs, Triton kernels run on the CPU through Triton's interpreter, mixture-of-
experts routing pinned to another run's choices."""

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: (device, dtype) of a model test: fp32 on the CPU (tight comparisons), bf16 on the GPU (the
#: serving dtype).
DEVICES = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32"),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=[pytest.mark.cuda, _no_cuda]),
]
#: The same with fp32 on the GPU too, for the tests that need fp32 arithmetic.
DEVICES_FP32 = [
    DEVICES[0],
    pytest.param(("cuda", torch.float32), id="cuda-fp32", marks=[pytest.mark.cuda, _no_cuda]),
]

#: Largest relative logits error (max |got - ref| / max |ref| per step) of a state mode against
#: eager fp32, teacher-forced, on a tiny model with fp32 activations, over a run with several
#: folds per row. Measured (Nemotron-H tiny, 48 steps, a fold every 4 tokens): fp32 state
#: 1.1e-6; a bf16 state or checkpoint 1.4e-3 to 3.5e-3; an fp8 checkpoint 1.5e-2. Each bound is
#: about 3x that, and far below the O(1) error of a wrong state.
MODE_TOLERANCE = {
    "eager-bf16": 1e-2,
    "replay-fp32": 1e-5,
    "replay-bf16": 1e-2,
    "replay-fp32+bf16": 1e-2,
    "replay-fp32+fp8": 5e-2,
}
#: Any comparison at bf16 activations (the GPU serving dtype), against transformers or between
#: modes: every activation rounds to bf16 (8 bits), and a 1-ulp flip early in the stack moves
#: the logits by a few bf16 steps. Measured on the CPU in bf16: 2.5e-2 between modes, 3.8e-2
#: against transformers over 64 decode steps; 2x that.
BF16_ACTIVATIONS_TOLERANCE = 8e-2


def mode_tolerance(mode: str, dtype) -> float:
    """The tolerance of ``mode`` (name without ':L') against eager fp32 at activations ``dtype``."""
    tol = MODE_TOLERANCE[mode.split(":")[0]]
    return max(tol, BF16_ACTIVATIONS_TOLERANCE) if dtype == torch.bfloat16 else tol


def tiny(family: str, device="cpu", seed: int = 1):
    """A tiny fp32 model of ``family`` ("nemotron_h" or "qwen3_5") with seeded random weights."""
    from replayssm.models import nemotron_h, qwen3_5

    if family == "nemotron_h":
        return nemotron_h.NemotronHModel.random(nemotron_h.NemotronHConfig.tiny(), seed=seed,
                                                device=device)
    return qwen3_5.Qwen35Model.random(qwen3_5.tiny_config(), seed=seed, device=device)


def perturbed(family: str, model, scale: float = 0.02, seed: int = 7):
    """A draft model: ``model``'s weights plus noise, so that it mostly agrees with it."""
    draft = tiny(family, next(model.parameters()).device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, q in zip(draft.parameters(), model.parameters()):
            noise = torch.randn(q.shape, generator=g).to(q.device)
            p.copy_(q + scale * q.abs().mean() * noise)
    return draft


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|, in float64."""
    got, ref = got.double(), ref.double()
    return float((got - ref).abs().max() / ref.abs().max())


@contextlib.contextmanager
def pinned_routing(routers, weights_of, record=None, replay=None, disagreeing=None,
                   method="forward"):
    """Within: each router's ``method`` (x -> (expert ids [T, k], weights [T, k]), patched on
    the instance) appends its ids to ``record[layer]`` call by call (``layer``: the router's
    index in ``routers``); or, with ``replay`` (an earlier run's ``record``, or one filled as
    the calls come), takes each call's ids from ``replay[layer]`` in turn, weighted by
    ``weights_of(router, x, ids)``: this run's own scores for those experts, as the router
    weighs its own choice. ``disagreeing`` gets, per replayed call, the number of tokens whose
    own choice (as a set) was another.

    Why: a choice is discontinuous. Two runs that differ by rounding (a lossy state, bf16
    against fp32, another implementation) can flip a near tie between experts and move that
    token's output by O(1); pinned, a comparison measures the rounding, and a wrong
    computation still errs by O(1)."""
    patched = []
    try:
        for layer, router in enumerate(routers):
            original = getattr(router, method)
            if record is not None:
                record[layer] = []

            def pinned(x, layer=layer, router=router, original=original):
                ids, weights = original(x)
                if record is not None:
                    record[layer].append(ids)
                    return ids, weights
                own, ids = ids, replay[layer].pop(0).view(ids.shape)
                if disagreeing is not None:
                    differs = own.sort(-1).values != ids.sort(-1).values
                    disagreeing.append(int(differs.any(-1).sum()))
                return ids, weights_of(router, x, ids)

            setattr(router, method, pinned)
            patched.append(router)
        yield
    finally:
        for router in patched:
            delattr(router, method)


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny models run ~100x faster on one thread of a loaded 2-core machine than on two
    (spinning OpenMP workers); restores the thread count after the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_INTERPRETER_PRELUDE = textwrap.dedent("""
    import torch
    from triton.runtime import interpreter
    # Triton 3.6's interpreter turns loop bounds into ints with int(array of shape (1,)), which
    # NumPy 2 refuses; read the element instead.
    _patch = interpreter._patch_lang_tensor
    def _patched(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = _patched
    torch.set_num_threads(1)
""")


#: Triton 3.6's interpreter truncates float32 to bf16 (half of all casts differ from round to
#: nearest even), so a bf16 result of a fused kernel may be a rounding or two further off there
#: than on the GPU.
INTERPRETER_BF16_TOL = 2.0 ** -4


def both_paths(fn):
    """fn() with the fused kernels (replayssm.models.fused) off, then on: (on, off)."""
    from replayssm.models import fused

    saved = fused._ENABLED
    try:
        fused._ENABLED = False
        ref = fn()
        fused._ENABLED = True
        got = fn()
    finally:
        fused._ENABLED = saved
    return got, ref


def run_in_triton_interpreter(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``script`` in a new Python process under Triton's interpreter (Triton kernels on CPU
    tensors, through NumPy; it must be switched on before triton is imported, hence a process),
    with the tests' directory on the path. The script reports a failure by its exit status."""
    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", _INTERPRETER_PRELUDE + textwrap.dedent(script)],
                          env=env, capture_output=True, text=True, timeout=timeout)


def check_captured_step(model, prompts, steps: int = 12) -> None:
    """model.step captured in a CUDA graph (replay fp32 folding every 4 tokens, a pad row) and
    replayed, against the same steps run eagerly on a second cache: identical logits across
    folds. ``prompts``: three int64 prompts on the GPU."""
    from replayssm.models import ServingCache

    caches = [ServingCache(model, 4, 128, "replay-fp32:4") for _ in range(2)]
    for c in caches:
        for p in prompts:
            model.prefill(c, c.allocate(), p)
    ids = torch.tensor([0, -1, 1, 2], dtype=torch.int32, device="cuda")
    static = torch.tensor([3, 3, 4, 5], device="cuda")
    eager_cache, graph_cache = caches
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (one step on each cache)
        for c in caches:
            model.step(c, ids, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model.step(graph_cache, ids, static)
    tokens = static.clone()
    for _ in range(steps):
        static.copy_(tokens)
        graph.replay()
        ref = model.step(eager_cache, ids, tokens)
        assert torch.equal(static_out[[0, 2, 3]], ref[[0, 2, 3]])
        tokens = ref.argmax(-1)


def check_rows_independent(model, prompts, device, steps: int = 12, tol: float = 0.0) -> None:
    """Row 0 (slot 0) beside different sequences and pad rows, in two caches, the second
    joined by a sequence after 5 steps (staggered start): bit-identical logits at every step,
    across folds (buffer length 4). ``prompts``: four int64 prompts on ``device``. With
    ``tol``, logits within ``tol`` (rel_err) instead: for models whose matrix products round a
    row differently with the number of rows beside it (grouped expert products)."""
    from replayssm.models import ServingCache

    runs = []
    for others, layout, late in (((1, 2), (0, 1, -1, 2), False), ((3,), (0, -1, 1, -1), True)):
        cache = ServingCache(model, 4, 128, "replay-fp32:4")
        slots = [cache.allocate() for _ in range(1 + len(others))]
        last = [model.prefill(cache, s, prompts[i])[-1] for s, i in zip(slots, (0, *others))]
        ids = torch.tensor([slots[i] if i >= 0 else -1 for i in layout], dtype=torch.int32,
                           device=device)
        tokens = torch.stack([last[i].argmax() if i >= 0 else torch.tensor(5, device=device)
                              for i in layout])
        row0 = []
        for step in range(steps):
            if step == 5 and late:  # a new sequence takes the pad row at index 3
                s = cache.allocate()
                tokens[3] = model.prefill(cache, s, prompts[2])[-1].argmax()
                ids[3] = s
            out = model.step(cache, ids, tokens)
            row0.append(out[0])
            tokens = out.argmax(-1)
        runs.append(torch.stack(row0))
    if tol:
        assert rel_err(runs[0], runs[1]) <= tol
    else:
        assert torch.equal(runs[0], runs[1])
