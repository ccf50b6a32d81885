"""What operators run between jobs: verify, preflight, prove, transfer, repro, rehearse, status, gc.

Each CLI command is one call into this package; it uses the core and the core never imports it.
"""
