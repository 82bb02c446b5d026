"""`python -m s3req.train ...` runs the `s3req` command line."""

import sys

from ._cli import main


sys.exit(main())
