"""Stable Diffusion 3 family."""
