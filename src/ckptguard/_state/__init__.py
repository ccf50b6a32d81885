"""_state: see docs/architecture.md."""
