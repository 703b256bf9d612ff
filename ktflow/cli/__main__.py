"""``python -m ktflow.cli``."""

from ktflow.cli import main

raise SystemExit(main())
