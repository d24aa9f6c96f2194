"""RL algorithms of the trainer: registries, advantage estimators, losses.

Importing this package imports nothing else; the built-in algorithms are registered on
the first registry lookup (see :mod:`omnirl.trainer.algorithms.registry`).
"""
