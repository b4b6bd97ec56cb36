"""An engine's decode loop in Python, on the CPU with NumPy: two sequences of a 2-layer Mamba-2
model decode 15 plain steps, then 15 speculative windows of 3 tokens of which a random number
is accepted. A replay cache (fp32+bf16 checkpoint) and an eager cache (the state itself)
run side by side; the outputs at accepted positions agree to bf16's precision.

    pip install .  &&  python examples/python_decode.py
"""

import numpy as np

import replayssm

rng = np.random.default_rng(0)
shape = dict(kind="mamba2", num_heads=8, head_dim=16, state_dim=32, num_groups=2,
             num_layers=2, capacity=4)
replay = replayssm.StateCache(replayssm.CacheConfig(
    **shape, checkpoint="fp32+bf16", buffer_len=8, max_spec_tokens=3))
eager = replayssm.StateCache(replayssm.CacheConfig(**shape, mode="eager"))
H, P, N, G = 8, 16, 32, 2

# Admit two sequences: a slot each, and the prefill's final state of every layer.
slots = np.array([replay.allocate(), replay.allocate()], np.int32)
assert [eager.allocate(), eager.allocate()] == slots.tolist()
for layer in range(2):
    for slot in slots:
        state = rng.standard_normal((H, P, N)).astype(np.float32) * 0.1
        replay.load_state(layer, slot, state)
        eager.load_state(layer, slot, state)
A = [-rng.uniform(0.5, 1.5, H).astype(np.float32) for _ in range(2)]
D = [np.ones(H, np.float32) for _ in range(2)]
dt_bias = [np.full(H, -3.0, np.float32) for _ in range(2)]


def token_inputs(T):
    """One step's inputs of one layer for both sequences, T tokens each."""
    def f(*s):
        return rng.standard_normal((2, T, *s)).astype(np.float32)

    return dict(x=f(H, P), dt=f(H), B=f(G, N), C=f(G, N), z=f(H, P))


worst, committed = 0.0, np.zeros(2, np.int64)
for step in range(30):
    T = 1 if step < 15 else 3  # plain decoding, then verify 1 real + 2 draft tokens
    inputs = [token_inputs(T) for _ in range(2)]
    accepted = np.full(2, T, np.int32) if T == 1 else rng.integers(1, T + 1, 2).astype(np.int32)
    ys = [replayssm.mamba2_decode(replay, layer, slots, A=A[layer], D=D[layer],
                                  dt_bias=dt_bias[layer], **inputs[layer]) for layer in range(2)]
    replay.commit(slots, accepted)  # every layer decoded the window: keep `accepted` of it
    # The eager cache decodes only the accepted tokens, one at a time.
    for t in range(accepted.max()):
        rows = np.where(accepted > t, slots, -1).astype(np.int32)  # -1: a pad row, skipped
        for layer in range(2):
            step = {k: np.ascontiguousarray(v[:, t:t + 1]) for k, v in inputs[layer].items()}
            y = replayssm.mamba2_decode(eager, layer, rows, A=A[layer], D=D[layer],
                                        dt_bias=dt_bias[layer], **step)
            for b in np.where(rows >= 0)[0]:
                worst = max(worst, np.abs(ys[layer][b, t] - y[b, 0]).max() / np.abs(y[b, 0]).max())
        eager.commit(rows, (rows >= 0).astype(np.int32))
    committed += accepted

state = replay.export_state(1, slots[0])
print(f"tokens committed per sequence: {committed.tolist()}; replay vs eager, accepted outputs: max relative difference "
      f"{worst:.1e}; exported state of layer 1: {state.shape} {state.dtype}")
assert worst < 2e-2, "replay and eager decoding disagree"
for slot in slots:
    replay.free(slot)
