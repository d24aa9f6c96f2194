"""omnirl.trainer."""
