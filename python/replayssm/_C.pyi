"""replayssm's compiled module (nanobind over include/replayssm/). Use the replayssm package:
its CacheConfig, StateCache and decode functions wrap these."""

from typing import Any, Sequence

built_with_cuda: bool

def cuda_available() -> bool: ...
def _set_dlpack_exchange(on: bool) -> None: ...

class Config:
    """A validated StateCacheConfig. d0..d3: Mamba-2 (nheads, head_dim, dstate, ngroups),
    GDN (num_k_heads, num_v_heads, head_k_dim, head_v_dim)."""

    def __init__(self, kind: str, d0: int, d1: int, d2: int, d3: int, num_layers: int,
                 capacity: int, buffer_len: int, max_spec_tokens: int, checkpoint: str,
                 mode: str, input_dtype: str, state_dtype: str, device: str,
                 share_forked_checkpoints: bool = False, conv_kernel: int = 0) -> None: ...
    def buffers(self) -> list[tuple[str, str, list[int], int, int, int]]:
        """(name, dtype, shape, bytes, alignment, slot_axis) of every buffer."""
    def can_implement(self) -> None:
        """Raises unless a backend of this build can run the configuration."""
    @property
    def ring_capacity(self) -> int: ...

class StateCache:
    """buffers: None (the cache allocates) or a dict name -> array (a view over them)."""

    def __init__(self, config: Config, buffers: dict[str, Any] | None, adopt: bool,
                 stream: Any) -> None: ...
    def allocate(self, stream: Any) -> int: ...
    def claim(self, slot: int, stream: Any) -> None: ...
    def free(self, slot: int, stream: Any) -> None: ...
    def load_state(self, layer: int, slot: int, state: Any, stream: Any) -> None: ...
    def export_state(self, layer: int, slot: int, out: Any, stream: Any) -> None: ...
    def load_conv_window(self, layer: int, slot: int, window: Any, stream: Any) -> None: ...
    def export_conv_window(self, layer: int, slot: int, out: Any, stream: Any) -> None: ...
    def commit(self, slot_ids: Any, accepted: Any, stream: Any,
               buffers: Sequence[Any] | None) -> None: ...
    def fold(self, slot_ids: Any, stream: Any, buffers: Sequence[Any] | None) -> None: ...
    def materialize(self, slot_ids: Any, positions: Any, out: Any, stream: Any,
                    buffers: Sequence[Any] | None) -> None:
        """slot_ids int32 [batch], positions int32/uint32 [batch] -> out float32
        [batch, num_layers, heads, rows, cols]."""
    def read_records(self, slot: int, first: int, vec: Any, key: Any, key_scale: Any | None,
                     write: Any, decay: Any, stream: Any,
                     buffers: Sequence[Any] | None) -> None:
        """Writes the records of positions first .. first + vec.shape[1] - 1."""
    def restore(self, slot: int, position: int, states: Any, vec: Any | None, key: Any | None,
                key_scale: Any | None, write: Any | None, decay: Any | None, stream: Any,
                buffers: Sequence[Any] | None, conv_window: Any | None = None) -> None:
        """states float32 [num_layers, heads, rows, cols]; records all None for none;
        conv_window [num_layers, conv_kernel - 1, conv_channels] (conv caches)."""
    def fork(self, src_slots: Any, dst_slots: Any, positions: Any, stream: Any,
             buffers: Sequence[Any] | None) -> None: ...
    def truncate(self, slot_ids: Any, positions: Any, stream: Any,
                 buffers: Sequence[Any] | None) -> None: ...
    def is_allocated(self, slot: int) -> bool: ...
    def buffer_arrays(self) -> dict[str, Any]: ...
    @property
    def free_slots(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def owns_memory(self) -> bool: ...
    @property
    def ring_capacity(self) -> int: ...
    @property
    def device_id(self) -> int: ...
    @property
    def calls_on_other_buffers(self) -> int: ...

def mamba2_decode(cache: StateCache, layer: int, slot_ids: Any, x: Any | None, dt: Any,
                  B: Any | None, C: Any | None, A: Any, D: Any, dt_bias: Any, z: Any | None,
                  out: Any, stream: Any, buffers: Sequence[Any] | None, conv_in: Any | None = None,
                  conv_weight: Any | None = None, conv_bias: Any | None = None,
                  fold_every: int = 0) -> None:
    """A conv cache (conv_kernel > 0): x, B, C None; conv_in [batch, T, conv_channels] (token
    rows), conv_weight float32 [conv_channels, conv_kernel], conv_bias float32 or None."""
def gdn_decode(cache: StateCache, layer: int, slot_ids: Any, q: Any | None, k: Any | None,
               v: Any | None, g: Any, beta: Any, scale: float, qk_l2norm: bool, out: Any,
               stream: Any, buffers: Sequence[Any] | None, conv_in: Any | None = None,
               conv_weight: Any | None = None, conv_bias: Any | None = None,
               fold_every: int = 0) -> None:
    """A conv cache: q, k, v None and the conv inputs, as mamba2_decode."""
