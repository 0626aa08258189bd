"""``python -m ppe_snapshot``: the ``ppe-snapshot`` command line."""
from ppe_snapshot.cli import main

raise SystemExit(main())
