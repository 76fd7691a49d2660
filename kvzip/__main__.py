"""python -m kvzip: the kvzip command."""
import sys

from .cli import main

sys.exit(main())
