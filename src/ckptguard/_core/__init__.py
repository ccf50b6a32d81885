"""The core under the front doors: one root's bookkeeping (docs/architecture.md)."""
