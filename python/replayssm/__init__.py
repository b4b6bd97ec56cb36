"""replayssm: decoding Mamba-2 and Gated DeltaNet layers by caching SSM inputs instead of state.

A :class:`StateCache` holds, for every slot (a decoding sequence) and layer, a checkpoint of the
recurrent state and a ring of the recent tokens' SSM inputs; :func:`mamba2_decode` and
:func:`gdn_decode` compute a step's outputs from the two, and :meth:`StateCache.commit` accepts
the tokens of a (speculative) window. For prefix caching, :meth:`StateCache.materialize`
gives the exact state at any committed token since the last fold, :meth:`StateCache.restore`
loads such an entry into a slot, :meth:`StateCache.fork` copies a slot at a position, and
:meth:`StateCache.truncate` rolls one back. Arrays are passed through DLPack, zero-copy: NumPy
arrays on the CPU, PyTorch (or CuPy) tensors on either device. ``replayssm.torch`` registers the ops
with PyTorch (``torch.library``) for CUDA graphs and ``torch.compile``.

Every error raises with the library's message (``ValueError`` for a bad argument,
``NotImplementedError`` for what this build or device does not support, ``MemoryError`` for a
full cache), and nothing is written when a call raises.
"""

from __future__ import annotations

import dataclasses
import sys
from importlib import metadata
from typing import Any, NamedTuple

from . import _C

try:
    __version__ = metadata.version("replayssm")
except metadata.PackageNotFoundError:  # imported from a source tree
    __version__ = "unknown"

__all__ = [
    "BufferSpec",
    "CacheConfig",
    "CacheRecords",
    "ConvInputs",
    "StateCache",
    "cache_buffers",
    "cuda_available",
    "gdn_decode",
    "mamba2_decode",
]

# Activation dtypes by the names NumPy and PyTorch give them, and the library's short ones.
_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}
_MAMBA2_DIMS = ("num_heads", "head_dim", "state_dim", "num_groups")
_GDN_DIMS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


def _dtype_name(dtype: Any, what: str) -> str:
    """'float32', 'bfloat16' or 'float16' for a name, a NumPy dtype or a torch.dtype."""
    if isinstance(dtype, str):
        text = dtype
    elif type(dtype).__module__ == "torch":
        text = str(dtype).removeprefix("torch.")
    else:
        import numpy

        text = numpy.dtype(dtype).name
    try:
        return _DTYPE_NAMES[text]
    except KeyError:
        raise ValueError(f"unsupported {what} {dtype!r}; choose float32, bfloat16 or float16") from None


def cuda_available() -> bool:
    """Whether this build has the CUDA backend and a usable GPU is present."""
    return _C.cuda_available()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """What a :class:`StateCache` holds: the layer kind and shape, how many layers and slots,
    and how the state is kept.

    Mamba-2 (``kind="mamba2"``) takes ``num_heads``, ``head_dim``, ``state_dim`` and
    ``num_groups``; Gated DeltaNet (``kind="gdn"``) takes ``num_k_heads``, ``num_v_heads``,
    ``head_k_dim`` and ``head_v_dim``.

    ``mode="replay"`` keeps a checkpoint plus a ring of recent inputs, folded every
    ``buffer_len`` committed tokens, and verifies windows of up to ``max_spec_tokens`` tokens;
    ``checkpoint`` picks its copies: ``"fp32"``, ``"bf16"``, ``"fp32+bf16"`` (outputs read a
    bf16 copy, folds an fp32 master) or ``"fp32+fp8"``. ``mode="eager"`` keeps the state itself
    in ``state_dtype``: with ``max_spec_tokens=1`` it decodes one token at a time, updating the
    state in place; with ``max_spec_tokens=T > 1`` it keeps T + 1 copies of each layer's state
    (per-draft-state speculation): a window of up to T tokens reads the current copy once and
    writes the state after each token into its own copy, and :meth:`StateCache.commit` makes
    the copy after the accepted tokens current (a second window must wait for the commit on
    the CPU; on CUDA it replaces the first). ``input_dtype`` is the dtype of the
    activations (inputs, ring and outputs). ``device`` is ``"cpu"`` or ``"cuda"`` (the current
    CUDA device). ``share_forked_checkpoints=True`` (replay only) makes :meth:`StateCache.fork`
    copy on fold: the copy reads its source's checkpoint until either of them first writes its
    own (a fold, a load, a restore, a fork onto it, a free), so a fork moves only ring records
    and cursors, and a copy freed before its first fold never copies the checkpoint; every
    decode then runs a short release pass first. ``conv_kernel=K`` (replay only, K in 2..8)
    makes the decodes apply the layer's causal conv1d themselves: they take the pre-conv inputs
    (:class:`ConvInputs`) instead of x, B, C or q, k, v, apply conv + bias + SiLU to the window
    in the same launch, and keep the last K - 1 tokens' inputs in the cache (no conv state of
    the caller's, no conv kernel); :meth:`StateCache.load_conv_window` sets a slot's window after
    a prefill. The library checks the configuration here, and what the device's backend
    supports when a cache is created.
    """

    kind: str
    capacity: int
    num_layers: int = 1
    num_heads: int | None = None
    head_dim: int | None = None
    state_dim: int | None = None
    num_groups: int | None = None
    num_k_heads: int | None = None
    num_v_heads: int | None = None
    head_k_dim: int | None = None
    head_v_dim: int | None = None
    buffer_len: int = 16
    max_spec_tokens: int = 1
    checkpoint: str = "fp32"
    mode: str = "replay"
    input_dtype: Any = "float32"
    state_dtype: Any = "float32"
    device: str = "cpu"
    share_forked_checkpoints: bool = False
    conv_kernel: int = 0
    _native: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dims = {"mamba2": _MAMBA2_DIMS, "gdn": _GDN_DIMS}.get(self.kind)
        if dims is None:
            raise ValueError(f"unknown kind {self.kind!r}; choose 'mamba2' or 'gdn'")
        other = _GDN_DIMS if dims is _MAMBA2_DIMS else _MAMBA2_DIMS
        missing = [d for d in dims if getattr(self, d) is None]
        if missing:
            raise TypeError(f"a {self.kind} CacheConfig needs {', '.join(missing)}")
        foreign = [d for d in other if getattr(self, d) is not None]
        if foreign:
            raise TypeError(f"{', '.join(foreign)} belong to the other layer kind, not {self.kind}")
        set_ = object.__setattr__
        set_(self, "input_dtype", _dtype_name(self.input_dtype, "input_dtype"))
        set_(self, "state_dtype", _dtype_name(self.state_dtype, "state_dtype"))
        d = [int(getattr(self, name)) for name in dims]
        set_(self, "_native", _C.Config(
            self.kind, *d, num_layers=self.num_layers, capacity=self.capacity,
            buffer_len=self.buffer_len, max_spec_tokens=self.max_spec_tokens,
            checkpoint=self.checkpoint, mode=self.mode, input_dtype=self.input_dtype,
            state_dtype=self.state_dtype, device=self.device,
            share_forked_checkpoints=bool(self.share_forked_checkpoints),
            conv_kernel=int(self.conv_kernel)))

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """One layer's state of one slot, as load_state takes and export_state returns it:
        Mamba-2 (num_heads, head_dim, state_dim), GDN (num_v_heads, head_v_dim, head_k_dim)."""
        if self.kind == "mamba2":
            return (self.num_heads, self.head_dim, self.state_dim)
        return (self.num_v_heads, self.head_v_dim, self.head_k_dim)

    @property
    def ring_capacity(self) -> int:
        """Ring entries per slot and layer (0 for eager caches)."""
        return self._native.ring_capacity

    @property
    def conv_channels(self) -> int:
        """Channels of the layer's causal conv1d, in the models' order: Mamba-2 x, B, C
        (num_heads * head_dim + 2 * num_groups * state_dim), GDN q, k, v (2 * num_k_heads *
        head_k_dim + num_v_heads * head_v_dim)."""
        if self.kind == "mamba2":
            return self.num_heads * self.head_dim + 2 * self.num_groups * self.state_dim
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def conv_window_shape(self) -> tuple[int, int]:
        """One layer's conv window of one slot, as load_conv_window takes it:
        (conv_kernel - 1, conv_channels)."""
        return (self.conv_kernel - 1, self.conv_channels)

    def record_shapes(self, count: int) -> "CacheRecords":
        """The shapes of :class:`CacheRecords` of ``count`` tokens (key_scale None for
        Mamba-2)."""
        heads, rows, cols = self.state_shape
        key_heads = self.num_groups if self.kind == "mamba2" else self.num_k_heads
        L = self.num_layers
        return CacheRecords(vec=(L, count, heads, rows), key=(L, count, key_heads, cols),
                            key_scale=(L, count, key_heads) if self.kind == "gdn" else None,
                            write=(L, count, heads), decay=(L, count, heads))


class ConvInputs(NamedTuple):
    """The pre-conv inputs of a decode on a cache with ``conv_kernel = K > 0``, in place of
    x, B, C (Mamba-2) or q, k, v (GDN): ``inputs`` [batch, T, conv_channels] in the input dtype,
    channels contiguous and token rows one stride apart (a column slice of the in-projection's
    output is), ``weight`` float32 [conv_channels, K] (the model's conv1d weight [C, 1, K] without
    its middle axis) and ``bias`` float32 [conv_channels] or None. Token t of a row gets
    u = SiLU(bias + sum over i < K of weight[c, i] * in(committed + t - (K - 1) + i)), in(p) the
    window's own token or, before the window, the cache's conv window."""

    inputs: Any
    weight: Any
    bias: Any = None


class CacheRecords(NamedTuple):
    """Ring records of ``count`` consecutive committed tokens of every layer of a slot, outside
    the cache: what :meth:`StateCache.read_records` returns and :meth:`StateCache.restore`
    takes, stored beside a materialized state (a few KB per token and layer, against a state's
    MBs). ``heads, rows, cols`` are ``CacheConfig.state_shape``; ``key_heads`` is Mamba-2's
    ``num_groups``, GDN's ``num_k_heads``. Arrays live where the cache's memory is (host for CPU
    caches, device for CUDA caches); see :meth:`CacheConfig.record_shapes`."""

    vec: Any
    """[num_layers, count, heads, rows] in the input dtype (Mamba-2 x, GDN v)."""
    key: Any
    """[num_layers, count, key_heads, cols] in the input dtype (Mamba-2 B, GDN raw k)."""
    key_scale: Any
    """GDN: [num_layers, count, key_heads] float32 (k's normalisation); None for Mamba-2."""
    write: Any
    """[num_layers, count, heads] float32 (Mamba-2 softplus(dt + dt_bias), GDN beta)."""
    decay: Any
    """[num_layers, count, heads] float32 (Mamba-2 A * that, GDN g)."""


class BufferSpec(NamedTuple):
    """One buffer of a cache configuration (see :func:`cache_buffers`)."""

    name: str
    """'state', 'ckpt_hi', 'ckpt_lo', 'ring_vec', ..., 'allocated'."""
    dtype: str
    """'float32', 'bfloat16', 'float16', 'float8_e4m3fn', 'uint8' or 'uint32'."""
    shape: tuple[int, ...]
    """Leading axes [num_layers, capacity] or [capacity]."""
    nbytes: int
    """Bytes the buffer needs (a caller's buffer may be larger)."""
    alignment: int
    """Bytes its start must be aligned to (256 for CUDA caches, 64 for CPU caches)."""
    slot_axis: int
    """The capacity (slot) axis: 1 for per-layer buffers, 0 for per-slot ones."""


def cache_buffers(config: CacheConfig) -> list[BufferSpec]:
    """Every buffer a cache of ``config`` needs, in the library's order. Slot ``s`` of every
    buffer is index ``s`` of its slot axis, so a slot can be copied or swapped with plain
    copies. Allocate them (any dtype: only the bytes, alignment and device matter) and pass
    them to ``StateCache(config, buffers={name: array})`` to keep the state in your memory."""
    return [BufferSpec(n, d, tuple(s), b, a, x) for n, d, s, b, a, x in config._native.buffers()]


def _empty_like(x: Any) -> Any:
    """A new array like ``x`` from ``x``'s own library (numpy, torch, cupy: its empty_like)."""
    package = sys.modules.get(type(x).__module__.partition(".")[0])
    empty_like = getattr(package, "empty_like", None)
    if empty_like is None:
        raise TypeError(f"cannot allocate an output like a {type(x).__name__}; pass out=")
    return empty_like(x)


class StateCache:
    """A state cache: slots of ``config.num_layers`` layers of one kind and shape.

    ``StateCache(config)`` allocates its buffers (host memory for CPU caches, device memory for
    CUDA caches). ``StateCache(config, buffers={name: array})`` is a view over the caller's
    arrays (see :func:`cache_buffers`), which must outlive it: an engine keeps the state in its
    own memory pool. With ``adopt=True`` the view keeps their contents (a cache rebuilt over the
    same memory: the allocated slots stay, with their state); otherwise it zeroes them.

    ``stream`` (here and on every method): for CUDA caches, the CUDA stream to order the work
    on, as an int (a ``cudaStream_t``) or a stream object (``torch.cuda.Stream``,
    ``cupy.cuda.Stream``). By default, the current stream of the arrays' framework where it
    says one (PyTorch), else CUDA's default stream. CPU caches ignore it.
    """

    def __init__(self, config: CacheConfig, buffers: dict[str, Any] | None = None, *,
                 adopt: bool = False, stream: Any = None) -> None:
        self.config = config
        self._native = _C.StateCache(config._native, buffers, adopt, self._stream(stream))
        #: name -> array over each buffer: the caller's arrays of a view; for an owning cache,
        #: NumPy arrays over its memory (CPU; bf16 as uint16 bits, fp8 as uint8 bits) or DLPack
        #: arrays (CUDA).
        self.buffers: dict[str, Any] = self._native.buffer_arrays()
        self._buffer_list = [self.buffers[spec.name] for spec in cache_buffers(config)]

    def __repr__(self) -> str:
        c = self.config
        return (f"StateCache({c.kind}, {c.mode}, device={c.device}, layers={c.num_layers}, "
                f"capacity={c.capacity}, free={self.free_slots}, "
                f"{'owning' if self.owns_memory else 'view'}, {self.nbytes} bytes)")

    @property
    def free_slots(self) -> int:
        return self._native.free_slots

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's buffers."""
        return self._native.nbytes

    @property
    def owns_memory(self) -> bool:
        """True for a cache that allocated its buffers, False for a view over the caller's."""
        return self._native.owns_memory

    @property
    def ring_capacity(self) -> int:
        return self._native.ring_capacity

    def is_allocated(self, slot: int) -> bool:
        return self._native.is_allocated(slot)

    def allocate(self, *, stream: Any = None) -> int:
        """Takes a free slot (zero state in every layer, empty ring) and returns its id;
        ``MemoryError`` when the cache is full."""
        return self._native.allocate(self._stream(stream))

    def claim(self, slot: int, *, stream: Any = None) -> None:
        """Takes the given free slot (for an engine that assigns slot ids itself)."""
        self._native.claim(slot, self._stream(stream))

    def free(self, slot: int, *, stream: Any = None) -> None:
        """Gives an allocated slot back."""
        self._native.free(slot, self._stream(stream))

    def load_state(self, layer: int, slot: int, state: Any, *, stream: Any = None) -> None:
        """Writes a full float32 state (``config.state_shape``) into one layer of a slot (the
        prefill hand-off): the eager state, or the checkpoint copies with an emptied ring. A
        CUDA cache also takes host memory. The state must be finite; no uncommitted window may
        be pending in that layer."""
        self._native.load_state(layer, slot, state, self._array_stream(stream, state))

    def export_state(self, layer: int, slot: int, out: Any = None, *, stream: Any = None) -> Any:
        """One layer's current state of a slot as float32 ``config.state_shape`` (a replay
        cache folds the layer's committed history first), written into ``out`` (host or, for a
        CUDA cache, device memory) or a new array (NumPy; for a ``replayssm.torch`` cache a
        tensor on its device); returns it."""
        if out is None:
            out = self._new_state()
        self._native.export_state(layer, slot, out, self._array_stream(stream, out))
        return out

    def load_conv_window(self, layer: int, slot: int, window: Any, *, stream: Any = None
                         ) -> None:
        """Conv caches: writes one layer's conv window of a slot, the pre-conv inputs of the
        ``conv_kernel - 1`` positions before its committed one (``config.conv_window_shape``,
        input dtype, oldest first; zeros for positions before a sequence's first token), the
        prefill hand-off beside :meth:`load_state`. A CUDA cache also takes host memory.
        Synchronises the stream."""
        self._native.load_conv_window(layer, slot, window, self._array_stream(stream, window))

    def export_conv_window(self, layer: int, slot: int, out: Any = None, *,
                           stream: Any = None) -> Any:
        """Conv caches: one layer's conv window of a slot (as :meth:`load_conv_window` takes
        it), written into ``out`` or a new array; returns it. Synchronises the stream."""
        if out is None and self.config.conv_kernel:  # without a conv the library refuses
            out = self._new_array(self.config.conv_window_shape, self.config.input_dtype)
        self._native.export_conv_window(layer, slot, out, self._array_stream(stream, out))
        return out

    def commit(self, slot_ids: Any, accepted: Any, *, stream: Any = None) -> None:
        """Accepts ``accepted[b]`` of the tokens the last decode appended to row ``b``, for
        every layer at once (int32 arrays [batch] in the cache's memory; slot id -1 is a pad
        row). A CPU cache refuses counts beyond the window and a window some layer did not
        decode; a CUDA cache clamps the count on the device (no host round trip)."""
        self._native.commit(slot_ids, accepted, self._array_stream(stream, slot_ids), None)

    def fold(self, slot_ids: Any, *, stream: Any = None) -> None:
        """Folds the committed history of every layer of these slots into their checkpoints
        now (decodes also fold by themselves once ``buffer_len`` tokens are due)."""
        self._native.fold(slot_ids, self._array_stream(stream, slot_ids), None)

    # ---- prefix caching ---------------------------------------------------------------------
    # Positions are a slot's cursor values: absolute token counts from its allocation (or from
    # the position a restore set), 32-bit and compared modulo 2^32 (int32 or uint32 arrays; the
    # same bits). A position p is in reach of a slot when folded <= p <= committed for every
    # layer (buffers "folded" [num_layers, capacity] and "committed" [capacity]): the tokens
    # since the slot's last fold, at most buffer_len - 1 + max_spec_tokens of them. Eager caches
    # refuse every prefix op (NotImplementedError): they hold only the state at their end.

    def materialize(self, slot_ids: Any, positions: Any, out: Any = None, *,
                    stream: Any = None) -> Any:
        """The exact state of every layer of slot ``slot_ids[b]`` after position
        ``positions[b]`` (int32 [batch] each, in the cache's memory; -1 = pad row, its output
        left as it was; a slot may repeat), as float32 [batch, num_layers, *config.state_shape]:
        what an engine stores as a prefix-cache entry. The cache is only read. With an fp32
        master checkpoint the state equals, bit for bit on the CPU, the checkpoint a fold to
        that position would store (a shared bf16 checkpoint stores it rounded to bf16).

        Written into ``out`` or a new array (NumPy for CPU caches; a ``replayssm.torch`` cache
        makes a tensor on its device; other CUDA caches need ``out``); returns it. A CPU cache
        refuses a slot not allocated or a position out of reach (ValueError, nothing written);
        a CUDA cache checks on the device without a host round trip: such rows are skipped,
        and a layer whose position is out of reach gets NaNs (which :meth:`restore` refuses)."""
        if out is None:
            out = self._new_states(len(slot_ids))
        self._native.materialize(slot_ids, positions, out, self._array_stream(stream, slot_ids),
                                 None)
        return out

    def read_records(self, slot: int, first: int, count: int, out: CacheRecords | None = None,
                     *, stream: Any = None) -> CacheRecords:
        """The ring records of positions ``first .. first + count - 1`` of ``slot`` (every
        layer), to store beside the state materialized at ``first``: with them, :meth:`restore`
        continues a hit that ends anywhere up to ``first + count``. ``first`` and
        ``first + count`` must both be in reach. Written into ``out`` (:class:`CacheRecords` of
        ``config.record_shapes(count)``) or new arrays; returns them. Synchronises the stream
        on CUDA caches."""
        if out is None:
            out = self._new_records(count)
        self._native.read_records(slot, first, *out, self._array_stream(stream, out.vec), None)
        return out

    def restore(self, slot: int, position: int, states: Any, records: CacheRecords | None = None,
                *, stream: Any = None, conv_window: Any = None) -> None:
        """Loads a stored entry into an allocated ``slot``, replacing everything of it: every
        layer's checkpoint from ``states`` (float32 [num_layers, *config.state_shape], finite;
        a low copy is rounded from it as a fold rounds), the slot's cursors at ``position``
        (folded = position, committed = position + records' count), and ``records`` (or None)
        of the tokens after it into the ring. Decoding on then equals decoding on from the slot
        the entry was taken from. Refused with nothing written: a slot not allocated or with an
        uncommitted window, a non-finite state, more records than a slot holds
        (buffer_len - 1 + max_spec_tokens), arrays of the wrong shape or dtype. Synchronises the
        stream on CUDA caches (not capturable in a CUDA graph). A conv cache also takes every
        layer's conv window at the restored committed end (``conv_window`` [num_layers,
        *config.conv_window_shape], as :meth:`load_conv_window` takes one layer's); other
        caches refuse it."""
        fields = (None,) * 5 if records is None else tuple(records)
        self._native.restore(slot, position, states, *fields,
                             self._array_stream(stream, states), None, conv_window)

    def fork(self, src_slots: Any, dst_slots: Any, positions: Any, *, stream: Any = None) -> Any:
        """Makes slot ``dst_slots[b]`` a copy of slot ``src_slots[b]`` at ``positions[b]``
        (int32 [batch] each, in the cache's memory; src -1 = pad row): every layer's
        checkpoint, the ring records up to the position, the cursors (committed = position, no
        uncommitted window). With ``config.share_forked_checkpoints`` the checkpoint is not
        copied: the copy reads its source's until either first writes its own (copy on fold;
        a fork then moves under a tenth of a state's bytes). The sources are only read (their
        ``ckpt_borrowers`` count aside); decoding a copy equals decoding its
        source from that position on (parallel sampling, beams). The dst slots must be
        allocated; ``dst_slots=None`` allocates one new slot per row (no pad rows then; CPU
        caches and ``replayssm.torch`` caches) and frees them again if the fork is refused.
        Returns the dst slots.

        A CPU cache refuses, with nothing written, a slot not allocated, a dst equal to its src,
        repeated, or the src of another row, and a position out of reach. A CUDA cache checks
        on the device: such rows are skipped (a dst that repeats or is another row's src is not
        detected there)."""
        allocated: list[int] = []
        try:
            if dst_slots is None:
                allocated += (self.allocate(stream=stream) for _ in range(len(src_slots)))
                dst_slots = self._new_rows(allocated)
            self._native.fork(src_slots, dst_slots, positions,
                              self._array_stream(stream, src_slots), None)
        except BaseException:
            for slot in allocated:
                self.free(slot, stream=stream)
            raise
        return dst_slots

    def truncate(self, slot_ids: Any, positions: Any, *, stream: Any = None) -> None:
        """Moves slot ``slot_ids[b]``'s committed end back to ``positions[b]`` (int32 [batch]
        each, in the cache's memory; -1 = pad row): the tokens after it are dropped, with any
        uncommitted window, and decoding on equals decoding from that position. A CPU cache
        refuses a slot not allocated or repeated and a position out of reach, with nothing
        changed; a CUDA cache skips such rows on the device (a repeat is not detected)."""
        self._native.truncate(slot_ids, positions, self._array_stream(stream, slot_ids), None)

    # Hooks for replayssm.torch: the stream of a call without arrays, and of one with `array`
    # (the compiled module takes the arrays' framework's current stream by itself where the
    # framework tells it), and the decodes (one Python call each: they are the hot path).
    def _stream(self, stream: Any) -> Any:
        return stream

    def _array_stream(self, stream: Any, array: Any) -> Any:
        return stream

    def _empty_like(self, x: Any) -> Any:
        return _empty_like(x)

    def _new_state(self) -> Any:
        return self._new_array(self.config.state_shape, "float32")

    def _new_array(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A new array of a library dtype name; NumPy holds bf16 as its uint16 bits."""
        if self.config.device != "cpu":
            raise TypeError("pass out= (arrays in the CUDA cache's device memory), or use a "
                            "replayssm.torch.StateCache, which allocates them")
        import numpy

        return numpy.empty(shape, numpy.uint16 if dtype == "bfloat16" else numpy.dtype(dtype))

    def _new_rows(self, values: list[int]) -> Any:
        """An int32 [batch] array of `values` where the cache's row lists live."""
        if self.config.device != "cpu":
            raise TypeError("pass dst_slots (an int32 array in the CUDA cache's device "
                            "memory), or use a replayssm.torch.StateCache")
        import numpy

        return numpy.array(values, numpy.int32)

    def _new_states(self, batch: int) -> Any:
        """materialize's output for `batch` rows."""
        c = self.config
        return self._new_array((batch, c.num_layers, *c.state_shape), "float32")

    def _new_records(self, count: int) -> CacheRecords:
        """read_records' output for `count` tokens: activations in the input dtype, the rest
        float32 (no key_scale for Mamba-2)."""
        act = self.config.input_dtype
        dtypes = (act, act, "float32", "float32", "float32")
        return CacheRecords(*(None if shape is None else self._new_array(shape, dtype)
                              for shape, dtype in zip(self.config.record_shapes(count), dtypes)))

    def _new_output(self, like: Any, shape: tuple[int, ...]) -> Any:
        """A decode's output of `shape` in `like`'s dtype and memory (conv caches, whose
        decodes have no x or q to allocate it like)."""
        import numpy

        return numpy.empty(shape, like.dtype)

    def _mamba2_decode(self, layer, slot_ids, x, dt, B, C, A, D, dt_bias, z, out, stream,
                       conv, fold_every):
        _C.mamba2_decode(self._native, layer, slot_ids, x, dt, B, C, A, D, dt_bias, z, out,
                         stream, None, *conv, fold_every)

    def _gdn_decode(self, layer, slot_ids, q, k, v, g, beta, scale, qk_l2norm, out, stream,
                    conv, fold_every):
        _C.gdn_decode(self._native, layer, slot_ids, q, k, v, g, beta, scale, qk_l2norm, out,
                      stream, None, *conv, fold_every)


_NO_CONV = (None, None, None)


def _decode_output(op: str, cache: StateCache, first: Any, conv: ConvInputs | None, heads: int,
                   dim: int) -> Any:
    """A new output [batch, T, heads, dim]: like the first activation, or on a conv cache in
    the pre-conv inputs' dtype and memory."""
    if conv is None and cache.config.conv_kernel:
        raise ValueError(f"{op}: a conv cache (conv_kernel > 0) takes conv=ConvInputs(...), the "
                         "pre-conv inputs")
    if conv is None:
        return cache._empty_like(first)
    batch, T = conv.inputs.shape[:2]
    return cache._new_output(conv.inputs, (batch, T, heads, dim))


def mamba2_decode(cache: StateCache, layer: int, slot_ids: Any, x: Any, dt: Any, B: Any, C: Any,
                  A: Any, D: Any, dt_bias: Any, z: Any = None, out: Any = None, *,
                  stream: Any = None, conv: ConvInputs | None = None, fold_every: int = 0) -> Any:
    """One Mamba-2 decode step of layer ``layer`` for the rows ``slot_ids`` (int32 [batch];
    -1 = pad row, nothing written), T tokens per row (T = 1: plain decoding; T > 1: verify a
    speculative window, then :meth:`StateCache.commit`).

    Shapes (dense, row-major, on the cache's device): ``x`` and ``z`` (optional gate)
    [batch, T, num_heads, head_dim] and ``B``, ``C`` [batch, T, num_groups, state_dim] in the
    cache's input dtype; ``dt`` [batch, T, num_heads] raw (before bias and softplus) and ``A``
    (< 0), ``D``, ``dt_bias`` [num_heads] in float32. Returns ``y`` [batch, T, num_heads,
    head_dim] in the input dtype, written into ``out`` when given. On a cache with
    ``conv_kernel > 0``, ``x``, ``B`` and ``C`` are None and ``conv`` (:class:`ConvInputs`)
    gives the pre-conv x, B, C.

    ``fold_every`` (replay caches): this call folds a row's committed history into its
    checkpoint once at least that many tokens of it wait, in [1, buffer_len]; 0 (the default)
    means buffer_len. It may change from call to call; eager caches take 0 only. A shorter
    cadence writes the checkpoint more often and leaves each step less history to replay:
    :class:`replayssm.models.ServingCache` shortens it for GDN layers at small batches."""
    c = cache.config
    if out is None:
        out = _decode_output("mamba2_decode", cache, x, conv, c.num_heads, c.head_dim)
    cache._mamba2_decode(layer, slot_ids, x, dt, B, C, A, D, dt_bias, z, out, stream,
                         _NO_CONV if conv is None else tuple(conv), int(fold_every))
    return out


def gdn_decode(cache: StateCache, layer: int, slot_ids: Any, q: Any, k: Any, v: Any, g: Any,
               beta: Any, scale: float | None = None, qk_l2norm: bool = True, out: Any = None, *,
               stream: Any = None, conv: ConvInputs | None = None, fold_every: int = 0) -> Any:
    """One Gated DeltaNet decode step of layer ``layer`` for the rows ``slot_ids`` (int32
    [batch]; -1 = pad row), T tokens per row (as :func:`mamba2_decode`).

    Shapes: ``q``, ``k`` [batch, T, num_k_heads, head_k_dim] and ``v`` [batch, T, num_v_heads,
    head_v_dim] in the cache's input dtype; ``g`` (log-decay, <= 0) and ``beta`` (in [0, 1])
    [batch, T, num_v_heads] in float32. ``qk_l2norm`` normalises q and k (eps 1e-6 under the
    root); ``scale`` multiplies q after that (None: head_k_dim ** -0.5). Returns ``o``
    [batch, T, num_v_heads, head_v_dim] in the input dtype, written into ``out`` when given. On
    a cache with ``conv_kernel > 0``, ``q``, ``k`` and ``v`` are None and ``conv``
    (:class:`ConvInputs`) gives the pre-conv q, k, v. ``fold_every``: the fold cadence of this
    call, as :func:`mamba2_decode`'s."""
    c = cache.config
    if out is None:
        out = _decode_output("gdn_decode", cache, v, conv, c.num_v_heads, c.head_v_dim)
    cache._gdn_decode(layer, slot_ids, q, k, v, g, beta, 0.0 if scale is None else float(scale),
                      bool(qk_l2norm), out, stream, _NO_CONV if conv is None else tuple(conv),
                      int(fold_every))
    return out
