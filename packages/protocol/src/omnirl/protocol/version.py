"""Protocol version carried by every message.

Minor versions only add optional fields with defaults, so a reader at minor N decodes a
message written at minor N+1 (unknown fields are ignored). A different major is refused.
"""

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 0
PROTOCOL_VERSION = (PROTOCOL_MAJOR, PROTOCOL_MINOR)


def format_version(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"
