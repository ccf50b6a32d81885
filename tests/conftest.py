import sys
from pathlib import Path

# Test helpers and fixture generators are imported by name, also in spawned ranks.
for sub in ("", "fixtures"):
    path = str(Path(__file__).parent / sub)
    if path not in sys.path:
        sys.path.insert(0, path)
