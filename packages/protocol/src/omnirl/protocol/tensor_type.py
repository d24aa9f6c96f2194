"""The annotation that marks a message field as a tensor travelling in its own frame.

At run time such a field holds a ``torch.Tensor``; on the wire the header holds a
:class:`TensorRef` (frame index, dtype, shape) and the bytes travel as a raw frame.
The annotation is a plain class so that importing the schemas does not import torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from torch import Tensor
else:

    class _TensorMeta(type):
        # msgspec checks that a decode hook returns an instance of the annotated type.
        # The codec's hook returns a TensorRef (replaced by a tensor right after), and at
        # run time the field holds a torch.Tensor: both count as a ``Tensor``.
        def __instancecheck__(cls, obj: object) -> bool:
            if isinstance(obj, TensorRef):
                return True
            torch = sys.modules.get("torch")  # not loaded: obj cannot be a torch.Tensor
            return torch is not None and isinstance(obj, torch.Tensor)

    class Tensor(metaclass=_TensorMeta):
        """Placeholder annotation: the value is a ``torch.Tensor`` at run time."""


class TensorRef(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """How a tensor field appears in the header: ``[frame, dtype, shape]``.

    ``frame`` indexes the multipart message (1 is the first frame after the header);
    ``dtype`` is one of :data:`omnirl.protocol.tensors.WIRE_DTYPES`; ``shape`` is the
    logical shape, C-contiguous on the wire.
    """

    frame: int
    dtype: str
    shape: tuple[int, ...]
