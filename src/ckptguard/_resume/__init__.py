"""The Resume-state contract: resolve, restore, captured state, RNG, digests, derived state and
proof records."""
