"""The engine-owned form: caches over buffers the caller allocated (NumPy arrays here) run
bit for bit like owning caches, adopt existing contents, and refuse bad bindings."""

import numpy as np
import pytest

import replayssm
from conftest import Driver, aligned_buffers, assert_same_bytes, config, snapshot


@pytest.mark.parametrize("kind,mode,checkpoint", [
    ("mamba2", "replay", "fp32+bf16"), ("gdn", "replay", "fp32+fp8"), ("gdn", "eager", "fp32"),
    ("mamba2", "replay", "bf16")])
def test_view_equals_owning_cache_bit_for_bit(kind, mode, checkpoint):
    cfg = config(kind, num_layers=2, mode=mode, checkpoint=checkpoint, buffer_len=4,
                 max_spec_tokens=1 if mode == "eager" else 2, input_dtype="bfloat16")
    owning = replayssm.StateCache(cfg)
    buffers = aligned_buffers(cfg, fill=0xAB)  # garbage: the view must zero it
    view = replayssm.StateCache(cfg, buffers=buffers)
    assert not view.owns_memory and owning.owns_memory
    assert view.buffers is buffers or view.buffers == buffers
    assert view.nbytes == owning.nbytes == sum(s.nbytes for s in replayssm.cache_buffers(cfg))
    T = 1 if mode == "eager" else 2
    drivers = [Driver(c, np.random.default_rng(7)) for c in (owning, view)]
    for step in range(11):
        for d in drivers:  # the same acceptance pattern for both
            accept = np.random.default_rng(step)
            d.step(T=T, accept=lambda T: int(accept.integers(1 if T == 1 else 0, T + 1)))
        assert_same_bytes(snapshot(view), snapshot(owning))
    # The view's arrays are the caller's memory: what the cache wrote is there.
    assert_same_bytes({k: np.array(v) for k, v in buffers.items()}, snapshot(owning))
    assert drivers[0].max_error == drivers[1].max_error


def test_adopt_keeps_slots_and_state(rng):
    cfg = config("gdn", buffer_len=4)
    buffers = aligned_buffers(cfg)
    first = replayssm.StateCache(cfg, buffers=buffers)
    d = Driver(first, rng)
    for _ in range(6):
        d.step()
    before = snapshot(first)
    del first
    again = replayssm.StateCache(cfg, buffers=buffers, adopt=True)
    assert_same_bytes(snapshot(again), before)
    assert [again.is_allocated(s) for s in range(4)] == [True, True, True, False]
    assert again.free_slots == 1
    d.cache = again  # decoding goes on where it stopped
    for _ in range(6):
        d.step()
    assert d.max_error <= 1e-5


def test_a_slot_copied_through_the_buffer_list(rng):
    """Slot s is index s of every buffer's slot axis: copying those rows copies the sequence."""
    cfg = config("mamba2", buffer_len=4)
    buffers = aligned_buffers(cfg)
    cache = replayssm.StateCache(cfg, buffers=buffers)
    d = Driver(cache, rng, batch=1)
    for _ in range(6):
        d.step()
    src, dst = d.slots[0], 2
    for spec in replayssm.cache_buffers(cfg):
        a = np.moveaxis(buffers[spec.name], spec.slot_axis, 0)
        a[dst] = a[src]
    again = replayssm.StateCache(cfg, buffers=buffers, adopt=True)
    assert again.is_allocated(dst)
    np.testing.assert_array_equal(again.export_state(0, dst), again.export_state(0, src))


def test_bad_bindings():
    cfg = config("mamba2")
    good = aligned_buffers(cfg)
    before = {k: v.copy() for k, v in good.items()}

    def refused(buffers, error, match):
        with pytest.raises(error, match=match):
            replayssm.StateCache(cfg, buffers=buffers)
        for k in good:  # nothing was zeroed
            assert np.array_equal(good[k], before[k])

    for k in good:
        good[k][...] = 1
        before[k][...] = 1
    missing = {k: v for k, v in good.items() if k != "ring_key"}
    refused(missing, ValueError, r"^cache buffer ring_key is not bound \(this configuration needs it\)$")
    refused({**good, "state": good["ckpt_hi"]}, ValueError,
            r"^cache buffer state is bound but this configuration has no such buffer$")
    refused({**good, "ckpt_low": good["ckpt_hi"]}, ValueError, r"^unknown cache buffer 'ckpt_low'")
    refused({**good, "ring_vec": good["ring_vec"][:-1]}, ValueError,
            r"^cache buffer ring_vec has \d+ bytes; it needs \d+$")
    raw = np.zeros(good["ckpt_hi"].nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64 + 4
    refused({**good, "ckpt_hi": raw[start:start + good["ckpt_hi"].nbytes]}, ValueError,
            r"^cache buffer ckpt_hi is not aligned to 64 bytes$")
    refused({**good, "ckpt_hi": np.asfortranarray(good["ckpt_hi"][0, 0])}, ValueError,
            r"^cache buffer ckpt_hi is not contiguous$")
    refused(list(good.values()), TypeError, r"^buffers must be a dict")
    ro = good["pending"].copy()
    ro.flags.writeable = False
    refused({**good, "pending": ro}, TypeError, r"pending must be a writable DLPack array")
    with pytest.raises(ValueError, match=r"^adopt=True needs buffers to adopt$"):
        replayssm.StateCache(cfg, adopt=True)


def test_owning_cache_buffers_are_numpy_views(rng):
    cfg = config("gdn", checkpoint="fp32+bf16", buffer_len=4)
    cache = replayssm.StateCache(cfg)
    specs = {s.name: s for s in replayssm.cache_buffers(cfg)}
    assert list(cache.buffers) == list(specs)
    for name, a in cache.buffers.items():
        assert a.shape == specs[name].shape and a.nbytes == specs[name].nbytes
    assert cache.buffers["ckpt_lo"].dtype == np.uint16  # bf16 bits
    slot = cache.allocate()
    assert cache.buffers["allocated"][slot] == 1
    state = rng.standard_normal(cfg.state_shape).astype(np.float32)
    cache.load_state(0, slot, state)
    np.testing.assert_array_equal(cache.buffers["ckpt_hi"][0, slot], state)
