"""``python -m stella_ps`` runs the daemon."""
import sys

from .daemon import main

sys.exit(main())
