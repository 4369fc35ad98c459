"""`python -m vitp.cli ...`: the same as `vitp ...` (job entrypoints and tests use this form)."""
import sys

from vitp.cli import main

sys.exit(main())
