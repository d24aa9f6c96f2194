"""omnirl.reward."""
