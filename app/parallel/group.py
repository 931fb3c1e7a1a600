"""A rank's tensor-parallel group: its rank, its size, `all_reduce` and `broadcast`.

The model takes the group as an argument (there is no module-global group). `SingleRank` is the
group of a model that is not split; `ShmGroup` is a real group whose collectives run natively over
one shared-memory segment (see native/src/collective.cpp): no Python and no pickling between ranks.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # not at run time: rank 0 starts its TP workers before it imports torch (app.engine.process)

ALL_REDUCE_SLOT = 8 << 20  # bytes per rank per all-reduce chunk; larger tensors go in several chunks
BROADCAST_BYTES = 16 << 20  # the largest step message


class SingleRank:
    """The group of one: collectives are no-ops."""

    rank, size = 0, 1
    native = None  # no native group to hand to native code (app.kernels.DecoderStack)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast(self, message: bytes | None, timeout: float = 0) -> bytes | None:
        return message

    def abort(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass


class ShmGroup:
    """Rank `rank` of `size`, over the shared-memory segment `name` (rank 0 creates it, the others attach).

    Collectives raise RuntimeError within seconds when another rank dies or calls `abort`, never hang.
    Once `wait_attached` returns the segment's name is gone from /dev/shm: nothing is left behind
    however the processes end.
    """

    def __init__(self, name: str, rank: int, size: int, *, slot_bytes: int = ALL_REDUCE_SLOT,
                 broadcast_bytes: int = BROADCAST_BYTES, attach_timeout: float = 120.0):
        from app import _native

        self.name, self.rank, self.size = name, rank, size
        self._group = _native.ShmGroup(name, rank, size, slot_bytes, broadcast_bytes, attach_timeout)

    @property
    def native(self):
        """The native group, for native code that runs collectives itself (app.kernels.DecoderStack)."""
        return self._group

    @staticmethod
    def new_name() -> str:
        return f"/appliance-tp-{uuid.uuid4().hex[:16]}"

    def wait_attached(self, timeout: float = 120.0) -> None:
        self._group.wait_attached(timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (contiguous float32 or bfloat16) over the group, in place; the same bits on every rank."""
        from app.kernels.ops import _ref

        if not tensor.is_contiguous():
            raise ValueError("all_reduce: the tensor must be contiguous")
        self._group.all_reduce(_ref(tensor, "tensor"))
        return tensor

    def broadcast(self, message: bytes | None, timeout: float = 0) -> bytes | None:
        """Rank 0 sends `message`; the others get it (None if nothing came within `timeout` s; 0: wait forever)."""
        return self._group.broadcast(message or b"", timeout)

    def set_timeout(self, seconds: float) -> None:
        """How long a collective waits for a live peer before it gives up (default 120 s)."""
        self._group.timeout = seconds

    def abort(self, reason: str) -> None:
        self._group.abort(reason)

    def close(self) -> None:
        self._group.close()
