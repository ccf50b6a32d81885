"""The version of ckptguard (one place; the manifest records it)."""

__version__ = "0.1.0"
