"""SDE schedulers shared by every flow-matching model family (float32 throughout)."""

from omnirl.models.schedulers.errors import SchedulerInputError
from omnirl.models.schedulers.flow_match_sde import SDE_TYPES, FlowMatchSDEScheduler, SDEStepOutput
from omnirl.models.schedulers.noise import initial_noise, per_sample_noise, stream_key
from omnirl.models.schedulers.window import noise_levels, random_window, window_mask

__all__ = [
    "SDE_TYPES",
    "FlowMatchSDEScheduler",
    "SDEStepOutput",
    "SchedulerInputError",
    "initial_noise",
    "noise_levels",
    "per_sample_noise",
    "random_window",
    "stream_key",
    "window_mask",
]
