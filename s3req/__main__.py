"""`python -m s3req ...` runs the `s3req` command line (`s3req train`, `compare`, `sample`)."""

import sys

from s3req.train._cli import main


sys.exit(main())
