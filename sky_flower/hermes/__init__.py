"""hermes."""
