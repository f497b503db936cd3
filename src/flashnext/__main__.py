"""`python -m flashnext ...`: the `flashnext` command line (the torchrun entry: `torchrun ... -m flashnext train`)."""

import sys

from flashnext.cli import main

sys.exit(main())
