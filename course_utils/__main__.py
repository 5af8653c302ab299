"""`python -m course_utils ...`: the command line (see course_utils.cli)."""

from .cli import main

raise SystemExit(main())
