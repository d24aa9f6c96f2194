"""omnirl.rollout."""
