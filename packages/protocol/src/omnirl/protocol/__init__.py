"""omnirl.protocol: message schemas and their wire format (no torch needed to import).

The codec API, re-exported here::

    frames = encode(msg)                    # [header, tensor frames...], no copies
    msg = decode(frames, max_bytes=...)     # tensors are views of the frames
    header = decode_header(frames[0])       # kind and version, without decoding
"""

from omnirl.protocol.codec import (
    DEFAULT_MAX_BYTES,
    Codec,
    Header,
    decode,
    decode_header,
    default_codec,
    encode,
    encoded_size,
)
from omnirl.protocol.errors import ProtocolError
from omnirl.protocol.version import PROTOCOL_MAJOR, PROTOCOL_MINOR, PROTOCOL_VERSION

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "PROTOCOL_VERSION",
    "Codec",
    "Header",
    "ProtocolError",
    "decode",
    "decode_header",
    "default_codec",
    "encode",
    "encoded_size",
]
