"""``python -m dtensor_patches`` runs the CLI."""

import sys

from dtensor_patches.cli import main

sys.exit(main())
