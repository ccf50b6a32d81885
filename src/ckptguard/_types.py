"""The two shapes ckptguard passes on without a record type of its own, named so that a signature
says which one it takes.

``StateDict``: a training state as its owner hands it over (nested dicts of tensors, ``Stateful``
objects and plain values; what DCP calls ``STATE_DICT_TYPE``), and the pieces ckptguard builds in
its image to load into (DCP's skeletons, the extras read back, an RNG's state). Its contents are
the caller's, so it is never typed further.

``JsonObject``: one JSON object on its way to or from a file or another rank: what a record's
``to_json`` returns and its ``from_json`` (or a wire message's reader) checks. Code past the reader
holds the record, not the object.
"""

from __future__ import annotations

from typing import Any, TypeAlias

StateDict: TypeAlias = dict[str, Any]
JsonObject: TypeAlias = dict[str, Any]
