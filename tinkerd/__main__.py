"""`python -m tinkerd`: the same command line as the `tinkerd` script."""

import sys

from tinkerd.cli.main import main

sys.exit(main())
