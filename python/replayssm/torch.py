"""replayssm for PyTorch: a state cache over torch tensors and the ops registered with
``torch.library`` (``torch.ops.replayssm.mamba2_decode``, ``gdn_decode``, ``commit``, ``fold``,
and the prefix-caching ``materialize``, ``read_records``, ``restore``, ``fork``, ``truncate``).

    import replayssm, replayssm.torch
    cache = replayssm.torch.StateCache(config)          # buffers: torch tensors on config.device
    y = replayssm.mamba2_decode(cache, layer, slot_ids, x, dt, B, C, A, D, dt_bias, z)
    cache.commit(slot_ids, accepted)

Streams. Every op runs on PyTorch's current stream of the tensors' device (what
``torch.cuda.current_stream()`` returns; inside ``torch.cuda.graph`` the capture stream), taken
through the DLPack C exchange API without a Python call; ``stream=`` overrides it. Nothing in a
decode or commit allocates or synchronises, so whole steps can be captured in a CUDA graph; nor
does materialize, fork or truncate with their lists and ``out`` given. ``restore`` and
``read_records`` synchronise (the library checks the slot's cursors on the host): they work under
``torch.compile`` but not inside a captured graph.

torch.compile. A cache's buffers are torch tensors, and every registered op declares them
mutated (``Tensor(a!)[] buffers``), along with ``out``: the compiler orders decodes and commits by
their effects on the cache, never drops one, and never reorders an op past a read of its output.
The cache itself travels as an int (its id in a registry of live caches), which Dynamo treats as
a constant. Inductor re-inplaces those mutations onto the cache's own buffers (the tests check
that a compiled step runs no op on copies). Called on a ``replayssm.torch.StateCache``, ``replayssm.mamba2_decode`` and friends
emit the registered ops while Dynamo traces (``torch.compile(fullgraph=True)`` works) and call
the library directly in eager mode, which skips the dispatcher's few microseconds per call.

An op handed buffers other than its cache's own (copies made by a graph transform, as
``torch.library.opcheck`` and un-reinplaced functionalization do) runs on those copies: the
declared effect is on the tensors it is given. That path builds a temporary view that reads the
copies' slot flags on the host (slow, not capturable), and is counted in
``StateCache.calls_on_other_buffers``.
"""

import itertools
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch.compiler import is_compiling as _is_compiling

from . import CacheConfig, CacheRecords, _C, cache_buffers
from . import StateCache as _StateCache

__all__ = ["StateCache", "allocate_buffers"]

# Buffer dtypes as torch tensors hold them. The u32 cursors live in int32 tensors: torch's
# uint32 lacks kernels (clone, copy) that graph transforms and tests use; the bits are the same.
_TORCH_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8, "uint32": torch.int32,
}

# Whether torch.Tensor publishes the DLPack C exchange API (PyTorch 2.10+): then the compiled
# module reads tensors and the current stream without Python calls; else the stream is asked
# for here.
_FAST_EXCHANGE = any(hasattr(torch.Tensor, name)
                     for name in ("__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__"))

_caches: "weakref.WeakValueDictionary[int, StateCache]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def allocate_buffers(config: CacheConfig, device: Any = None) -> Dict[str, torch.Tensor]:
    """Uninitialised torch tensors for every buffer of ``config`` (see
    :func:`replayssm.cache_buffers`), on ``device`` (default: ``config.device``). PyTorch's
    allocators align them as the library needs (64 bytes on the CPU, 512 on CUDA)."""
    device = torch.device(config.device if device is None else device)
    return {s.name: torch.empty(s.shape, dtype=_TORCH_DTYPES[s.dtype], device=device)
            for s in cache_buffers(config)}


def _current_stream(t: torch.Tensor) -> Optional[int]:
    """The stream the compiled module would take for ``t`` when the exchange API is there."""
    if _FAST_EXCHANGE or not t.is_cuda:
        return None
    return torch.cuda.current_stream(t.device).cuda_stream


def _no_stream_when_compiling(stream: Any) -> None:
    if stream is not None:
        raise ValueError("under torch.compile the ops run on the current stream; pass no stream "
                         "(use torch.cuda.stream(...) around the call)")


class StateCache(_StateCache):
    """A :class:`replayssm.StateCache` whose buffers are torch tensors: allocated here (on
    ``device``, default ``config.device``) or the caller's (``buffers``: name -> tensor, e.g.
    from :func:`allocate_buffers` or an engine's pool). Decodes, commits and folds on it follow
    PyTorch's current stream and work under ``torch.compile`` and CUDA graph capture.

    Its CUDA ops run on the current CUDA device: make it the one its buffers are on."""

    def __init__(self, config: CacheConfig, buffers: Optional[Dict[str, torch.Tensor]] = None, *,
                 adopt: bool = False, stream: Any = None, device: Any = None) -> None:
        if buffers is None:
            if adopt:
                raise ValueError("adopt=True needs buffers to adopt")
            buffers = allocate_buffers(config, device)
        not_tensors = [name for name, b in buffers.items() if not isinstance(b, torch.Tensor)]
        if not_tensors:
            raise TypeError(f"buffers must be torch tensors: {', '.join(not_tensors)}")
        super().__init__(config, buffers, adopt=adopt, stream=stream)
        self._id = next(_ids)
        _caches[self._id] = self

    @property
    def calls_on_other_buffers(self) -> int:
        """Ops that ran on copies of the buffers rather than on the buffers (see the module's
        documentation): 0 in eager mode and in a well-compiled graph."""
        return self._native.calls_on_other_buffers

    def commit(self, slot_ids: torch.Tensor, accepted: torch.Tensor, *, stream: Any = None) -> None:
        if _is_compiling():
            _no_stream_when_compiling(stream)
            torch.ops.replayssm.commit(self._id, slot_ids, accepted, self._buffer_list)
        else:
            super().commit(slot_ids, accepted, stream=stream)

    def fold(self, slot_ids: torch.Tensor, *, stream: Any = None) -> None:
        if _is_compiling():
            _no_stream_when_compiling(stream)
            torch.ops.replayssm.fold(self._id, slot_ids, self._buffer_list)
        else:
            super().fold(slot_ids, stream=stream)

    def _stream(self, stream: Any) -> Any:
        if stream is None and self.config.device == "cuda":
            return torch.cuda.current_stream().cuda_stream
        return stream

    def _array_stream(self, stream: Any, t: torch.Tensor) -> Any:
        return stream if stream is not None or _FAST_EXCHANGE else self._stream(None)

    def _empty_like(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def _new_array(self, shape: Any, dtype: str) -> torch.Tensor:
        return torch.empty(shape, dtype=_TORCH_DTYPES[dtype], device=self._buffer_list[0].device)

    def _new_rows(self, values: List[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self._buffer_list[0].device)

    def _new_output(self, like: torch.Tensor, shape: Any) -> torch.Tensor:
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    # The prefix ops: registered ops while Dynamo traces, the library directly otherwise.
    def materialize(self, slot_ids: torch.Tensor, positions: torch.Tensor,
                    out: Optional[torch.Tensor] = None, *, stream: Any = None) -> torch.Tensor:
        if not _is_compiling():
            return super().materialize(slot_ids, positions, out, stream=stream)
        _no_stream_when_compiling(stream)
        if out is None:
            out = self._new_states(slot_ids.shape[0])
        torch.ops.replayssm.materialize(self._id, slot_ids, positions, out, self._buffer_list)
        return out

    def read_records(self, slot: int, first: int, count: int,
                     out: Optional[CacheRecords] = None, *, stream: Any = None) -> CacheRecords:
        if not _is_compiling():
            return super().read_records(slot, first, count, out, stream=stream)
        _no_stream_when_compiling(stream)
        if out is None:
            out = self._new_records(count)
        torch.ops.replayssm.read_records(self._id, slot, first, *out, self._buffer_list)
        return out

    def restore(self, slot: int, position: int, states: torch.Tensor,
                records: Optional[CacheRecords] = None, *, stream: Any = None,
                conv_window: Optional[torch.Tensor] = None) -> None:
        if not _is_compiling():
            return super().restore(slot, position, states, records, stream=stream,
                                   conv_window=conv_window)
        _no_stream_when_compiling(stream)
        fields = (None,) * 5 if records is None else tuple(records)
        torch.ops.replayssm.restore(self._id, slot, position, states, *fields, self._buffer_list,
                                    conv_window)

    def fork(self, src_slots: torch.Tensor, dst_slots: Optional[torch.Tensor],
             positions: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
        if not _is_compiling():
            return super().fork(src_slots, dst_slots, positions, stream=stream)
        _no_stream_when_compiling(stream)
        if dst_slots is None:
            raise ValueError("under torch.compile fork takes dst_slots (allocating slots is a "
                             "host decision: allocate them before the compiled step)")
        torch.ops.replayssm.fork(self._id, src_slots, dst_slots, positions, self._buffer_list)
        return dst_slots

    def truncate(self, slot_ids: torch.Tensor, positions: torch.Tensor, *,
                 stream: Any = None) -> None:
        if not _is_compiling():
            return super().truncate(slot_ids, positions, stream=stream)
        _no_stream_when_compiling(stream)
        torch.ops.replayssm.truncate(self._id, slot_ids, positions, self._buffer_list)

    def _mamba2_decode(self, layer, slot_ids, x, dt, B, C, A, D, dt_bias, z, out, stream,
                       conv, fold_every):
        if _is_compiling():
            _no_stream_when_compiling(stream)
            torch.ops.replayssm.mamba2_decode(self._id, layer, slot_ids, x, dt, B, C, A, D,
                                              dt_bias, z, out, self._buffer_list, *conv,
                                              fold_every)
        else:
            # _array_stream inlined: this is the eager hot path.
            _C.mamba2_decode(self._native, layer, slot_ids, x, dt, B, C, A, D, dt_bias, z, out,
                             stream if stream is not None or _FAST_EXCHANGE
                             else self._stream(None), None, *conv, fold_every)

    def _gdn_decode(self, layer, slot_ids, q, k, v, g, beta, scale, qk_l2norm, out, stream,
                    conv, fold_every):
        if _is_compiling():
            _no_stream_when_compiling(stream)
            torch.ops.replayssm.gdn_decode(self._id, layer, slot_ids, q, k, v, g, beta, scale,
                                           qk_l2norm, out, self._buffer_list, *conv, fold_every)
        else:
            _C.gdn_decode(self._native, layer, slot_ids, q, k, v, g, beta, scale, qk_l2norm, out,
                          stream if stream is not None or _FAST_EXCHANGE
                          else self._stream(None), None, *conv, fold_every)


def _cache(cache_id: int) -> StateCache:
    cache = _caches.get(cache_id)
    if cache is None:
        raise ValueError(f"no live replayssm.torch.StateCache has id {cache_id}")
    return cache


# ---- the registered ops -----------------------------------------------------------------------
# Each takes the cache's id and its buffer list (the tensors it mutates), returns nothing and
# writes `out`; replayssm.mamba2_decode / gdn_decode allocate `out` and return it.

@torch.library.custom_op("replayssm::mamba2_decode", mutates_args=("out", "buffers"))
def _mamba2_decode_op(cache: int, layer: int, slot_ids: torch.Tensor, x: Optional[torch.Tensor],
                      dt: torch.Tensor, B: Optional[torch.Tensor], C: Optional[torch.Tensor],
                      A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                      z: Optional[torch.Tensor], out: torch.Tensor, buffers: List[torch.Tensor],
                      conv_in: Optional[torch.Tensor] = None,
                      conv_weight: Optional[torch.Tensor] = None,
                      conv_bias: Optional[torch.Tensor] = None, fold_every: int = 0) -> None:
    """replayssm.mamba2_decode on the cache with id ``cache``, writing ``out`` (a conv cache:
    x, B, C None and the ConvInputs' three tensors after the buffers)."""
    _C.mamba2_decode(_cache(cache)._native, layer, slot_ids, x, dt, B, C, A, D, dt_bias, z, out,
                     _current_stream(out), buffers, conv_in, conv_weight, conv_bias, fold_every)


@_mamba2_decode_op.register_fake
def _(cache, layer, slot_ids, x, dt, B, C, A, D, dt_bias, z, out, buffers, conv_in=None,
      conv_weight=None, conv_bias=None, fold_every=0):
    return None


@torch.library.custom_op("replayssm::gdn_decode", mutates_args=("out", "buffers"))
def _gdn_decode_op(cache: int, layer: int, slot_ids: torch.Tensor, q: Optional[torch.Tensor],
                   k: Optional[torch.Tensor], v: Optional[torch.Tensor], g: torch.Tensor,
                   beta: torch.Tensor, scale: float, qk_l2norm: bool, out: torch.Tensor,
                   buffers: List[torch.Tensor], conv_in: Optional[torch.Tensor] = None,
                   conv_weight: Optional[torch.Tensor] = None,
                   conv_bias: Optional[torch.Tensor] = None, fold_every: int = 0) -> None:
    """replayssm.gdn_decode on the cache with id ``cache`` (scale 0 = head_k_dim ** -0.5; a
    conv cache: q, k, v None and the ConvInputs' three tensors after the buffers)."""
    _C.gdn_decode(_cache(cache)._native, layer, slot_ids, q, k, v, g, beta, scale, qk_l2norm,
                  out, _current_stream(out), buffers, conv_in, conv_weight, conv_bias, fold_every)


@_gdn_decode_op.register_fake
def _(cache, layer, slot_ids, q, k, v, g, beta, scale, qk_l2norm, out, buffers, conv_in=None,
      conv_weight=None, conv_bias=None, fold_every=0):
    return None


@torch.library.custom_op("replayssm::commit", mutates_args=("buffers",))
def _commit_op(cache: int, slot_ids: torch.Tensor, accepted: torch.Tensor,
               buffers: List[torch.Tensor]) -> None:
    """StateCache.commit on the cache with id ``cache``."""
    _cache(cache)._native.commit(slot_ids, accepted, _current_stream(slot_ids), buffers)


@_commit_op.register_fake
def _(cache, slot_ids, accepted, buffers):
    return None


@torch.library.custom_op("replayssm::fold", mutates_args=("buffers",))
def _fold_op(cache: int, slot_ids: torch.Tensor, buffers: List[torch.Tensor]) -> None:
    """StateCache.fold on the cache with id ``cache``."""
    _cache(cache)._native.fold(slot_ids, _current_stream(slot_ids), buffers)


@_fold_op.register_fake
def _(cache, slot_ids, buffers):
    return None


# ---- the prefix ops ---------------------------------------------------------------------------
# materialize and read_records only read the cache: their buffers are inputs, so the compiler
# orders them after every earlier mutation of the cache and before every later one. Like the
# ops above, none returns anything: their fakes have nothing to build.

def _returns_nothing(*args: Any) -> None:
    return None


@torch.library.custom_op("replayssm::materialize", mutates_args=("out",))
def _materialize_op(cache: int, slot_ids: torch.Tensor, positions: torch.Tensor,
                    out: torch.Tensor, buffers: List[torch.Tensor]) -> None:
    """StateCache.materialize on the cache with id ``cache``, writing ``out``."""
    _cache(cache)._native.materialize(slot_ids, positions, out, _current_stream(slot_ids),
                                      buffers)


_materialize_op.register_fake(_returns_nothing)


@torch.library.custom_op("replayssm::read_records",
                         mutates_args=("vec", "key", "key_scale", "write", "decay"))
def _read_records_op(cache: int, slot: int, first: int, vec: torch.Tensor, key: torch.Tensor,
                     key_scale: Optional[torch.Tensor], write: torch.Tensor,
                     decay: torch.Tensor, buffers: List[torch.Tensor]) -> None:
    """StateCache.read_records on the cache with id ``cache``, writing the record tensors."""
    _cache(cache)._native.read_records(slot, first, vec, key, key_scale, write, decay,
                                       _current_stream(vec), buffers)


_read_records_op.register_fake(_returns_nothing)


@torch.library.custom_op("replayssm::restore", mutates_args=("buffers",))
def _restore_op(cache: int, slot: int, position: int, states: torch.Tensor,
                vec: Optional[torch.Tensor], key: Optional[torch.Tensor],
                key_scale: Optional[torch.Tensor], write: Optional[torch.Tensor],
                decay: Optional[torch.Tensor], buffers: List[torch.Tensor],
                conv_window: Optional[torch.Tensor] = None) -> None:
    """StateCache.restore on the cache with id ``cache`` (records all None for none)."""
    _cache(cache)._native.restore(slot, position, states, vec, key, key_scale, write, decay,
                                  _current_stream(states), buffers, conv_window)


_restore_op.register_fake(_returns_nothing)


@torch.library.custom_op("replayssm::fork", mutates_args=("buffers",))
def _fork_op(cache: int, src_slots: torch.Tensor, dst_slots: torch.Tensor,
             positions: torch.Tensor, buffers: List[torch.Tensor]) -> None:
    """StateCache.fork on the cache with id ``cache``."""
    _cache(cache)._native.fork(src_slots, dst_slots, positions, _current_stream(src_slots),
                               buffers)


_fork_op.register_fake(_returns_nothing)


@torch.library.custom_op("replayssm::truncate", mutates_args=("buffers",))
def _truncate_op(cache: int, slot_ids: torch.Tensor, positions: torch.Tensor,
                 buffers: List[torch.Tensor]) -> None:
    """StateCache.truncate on the cache with id ``cache``."""
    _cache(cache)._native.truncate(slot_ids, positions, _current_stream(slot_ids), buffers)


_truncate_op.register_fake(_returns_nothing)
