"""The File contract: the commit protocol, the on-disk layout, manifest, lease, rotation and step
checks."""
