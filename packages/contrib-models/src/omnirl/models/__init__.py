"""omnirl.models: model adapters, one folder per model family, and the shared SDE schedulers."""
