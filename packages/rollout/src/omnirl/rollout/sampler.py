"""The sampling thread of a rollout worker: it alone touches the model.

Jobs run one at a time, in the order submitted: build the adapter, apply a weight version,
sample a lease. Because weights are applied by a job of their own, never inside a lease's
job, a version change can only happen between leases, and every group a lease job returns
was sampled wholly at the version that job reports.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("omnirl.rollout")


@dataclass(slots=True)
class JobResult:
    kind: str  # "load" | "apply" | "lease"
    ok: bool
    value: Any = None  # lease: list of groups; apply: the version applied
    error: str = ""
    error_type: type | None = None  # the failure's exception class (not the instance: frames)
    seconds: float = 0.0
    ref: Any = None  # lease: the Lease; apply: the assembled update

    @property
    def bad_sampling(self) -> bool:
        """Whether the job failed on sampling parameters the model refuses (a configuration
        error every worker would hit), not on this worker's circumstances."""
        if self.error_type is None:
            return False
        from omnirl.models.base import SamplingParamsError  # torch is loaded: a job ran

        return issubclass(self.error_type, SamplingParamsError)


class SamplerThread:
    """A daemon thread running model jobs; results come back on :attr:`results`."""

    def __init__(self) -> None:
        self.results: queue.Queue[JobResult] = queue.Queue()
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Jobs submitted whose results have not yet been taken with :meth:`poll`."""
        return self._pending > 0

    def submit(self, kind: str, fn, ref: Any = None) -> None:
        self._pending += 1
        self._jobs.put((kind, fn, ref))

    def poll(self) -> list[JobResult]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                break
        self._pending -= len(out)
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop after the running job (if any); wait up to ``timeout_s`` for it."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, fn, ref = job
            t0 = time.perf_counter()
            try:
                value = fn()
                result = JobResult(kind, True, value, ref=ref)
            except Exception as exc:  # reported to the loop, which decides; never fatal here
                detail = traceback.format_exc(limit=8)
                log.error("sampler job %s failed: %s\n%s", kind, exc, detail)
                result = JobResult(
                    kind, False, error=f"{type(exc).__name__}: {exc}", error_type=type(exc), ref=ref
                )
            result.seconds = time.perf_counter() - t0
            self.results.put(result)
