"""Typed errors of the SDE scheduler."""


class SchedulerInputError(ValueError):
    """An argument of the SDE scheduler is malformed (dtype, shape, range or unknown name)."""
