"""bench/ is not an installed package: make `import bench` work from the repository root.

Appended, not prepended, to sys.path so the root's folders never shadow anything installed.
"""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.append(ROOT)
