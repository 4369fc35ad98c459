"""`python -m pipeline.cli ...`: the same as `vitp ...` (job entrypoints and tests use this form)."""
import sys

from pipeline.cli import main

sys.exit(main())
