"""_disk: see docs/architecture.md."""
