"""omnirl.protocol."""
