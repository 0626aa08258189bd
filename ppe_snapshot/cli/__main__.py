"""``python -m ppe_snapshot.cli``."""
import sys

from ppe_snapshot.cli import main

sys.exit(main())
