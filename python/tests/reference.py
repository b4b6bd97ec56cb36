"""The float64 oracle (docs/ALGORITHM.md §1, §2): one token of one sequence, plain loops of the
math as written, no replay, no shortcuts. Inputs are the values the library sees (already
rounded to the cache's input dtype); the state and the outputs are float64."""

import numpy as np


def softplus(u):
    """log(1 + e^u), = u past 20 (as the models do)."""
    u = np.asarray(u, np.float64)
    return np.where(u > 20.0, u, np.log1p(np.exp(np.minimum(u, 20.0))))


def silu(u):
    u = np.asarray(u, np.float64)
    return u / (1.0 + np.exp(-u))


def mamba2_step(S, x, dt, B, C, z, A, D, dt_bias):
    """One Mamba-2 token: S [H, P, N] (float64, returned updated), x and z [H, P] (z may be
    None), dt [H] raw, B and C [G, N], A, D, dt_bias [H]. Returns (S, y [H, P])."""
    H = S.shape[0]
    group = np.arange(H) // (H // B.shape[0])
    delta = softplus(dt.astype(np.float64) + dt_bias)
    a = np.exp(A.astype(np.float64) * delta)
    Bh, Ch = B[group].astype(np.float64), C[group].astype(np.float64)
    x = x.astype(np.float64)
    S = a[:, None, None] * S + delta[:, None, None] * x[:, :, None] * Bh[:, None, :]
    y = np.einsum("hpn,hn->hp", S, Ch) + D.astype(np.float64)[:, None] * x
    if z is not None:
        y = y * silu(z)
    return S, y


def gdn_step(S, q, k, v, g, beta, qk_l2norm=True, scale=None):
    """One Gated DeltaNet token: S [Hv, V, K] (float64, returned updated), q and k [Hk, K],
    v [Hv, V], g and beta [Hv]. Returns (S, o [Hv, V])."""
    Hv, _, K = S.shape
    key = np.arange(Hv) // (Hv // q.shape[0])
    q, k = q.astype(np.float64), k.astype(np.float64)
    if qk_l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q * (K ** -0.5 if not scale else scale)
    qh, kh = q[key], k[key]
    alpha = np.exp(g.astype(np.float64))
    d = beta.astype(np.float64)[:, None] * (
        v.astype(np.float64) - alpha[:, None] * np.einsum("hvk,hk->hv", S, kh))
    S = alpha[:, None, None] * S + d[:, :, None] * kh[:, None, :]
    return S, np.einsum("hvk,hk->hv", S, qh)
