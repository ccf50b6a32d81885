"""The embedded demo job (``ckptguard demo``, ``python -m ckptguard.demo``) and the toy job the
tests use."""
