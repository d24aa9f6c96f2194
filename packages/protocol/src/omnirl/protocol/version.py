"""Protocol version carried by every message.

Minor versions only add optional fields with defaults, so a reader at minor N decodes a
message written at minor N+1 (unknown fields are ignored), or add message kinds, which a
reader at minor N refuses as unknown kinds while the rest of the exchange goes on. A
different major is refused.

1.1: ``LeaseReturn`` (a rollout worker gives back a lease whose sampling failed).
1.2: ``WorkerStatus.benched_s`` (a worker refused leases after its leases kept failing).
1.3: ``Refusal.retry_after_s`` (how long the same request will be refused: a bench).
1.4: ``LeaseReturn.bad_sampling`` (the model cannot honour the lease's sampling parameters).
"""

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 4
PROTOCOL_VERSION = (PROTOCOL_MAJOR, PROTOCOL_MINOR)


def format_version(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"
