"""``gpu_sd35m.py``'s memory stages (a mixin of its ``Bench``): a rollout lease's
device-memory peak by decode batch."""

from __future__ import annotations


class MemoryStages:
    """Stages that measure device memory; they use ``Bench``'s rollout, sampling and report."""

    def stage_decode_memory(self) -> None:
        """A lease's device-memory peak with all its images in one VAE call and with the
        worker's ``--decode-batch`` 4 and 1: what a rollout worker beside the trainer needs
        (rows ``decode_memory_all`` / ``_4`` / ``_1``; no peaks on a CPU)."""
        from omnirl.models.device import peak_memory_gb, reset_peak_memory, synchronize

        if not hasattr(self, "rollout"):
            self.build_omnirl(trainer=False)
        self.sample()  # warm (a compiled backend's first call compiles)
        synchronize(self.device)
        n = self.setup.images
        for batch in (0, 4, 1):
            self.rollout.set_decode_batch(batch)
            self._free()
            reset_peak_memory(self.device)
            held = peak_memory_gb(self.device).get("allocated")  # the weights, the inputs
            _, secs = self.sample()
            peak = peak_memory_gb(self.device)
            self.report.add(
                f"decode_memory_{batch or 'all'}",
                images_per_vae_call=batch or n,
                s_per_image=secs / n,
                held_gb=held,
                lease_peak_allocated_gb=peak.get("allocated"),
                lease_peak_reserved_gb=peak.get("reserved"),
            )
        self.rollout.set_decode_batch(0)
