"""omnirl.tools: command-line tools."""
