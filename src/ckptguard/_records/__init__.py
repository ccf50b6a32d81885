"""_records: see docs/architecture.md."""
