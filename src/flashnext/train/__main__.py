"""`python -m flashnext.train --config run.toml [--section.field=value ...]` (also under torchrun)."""

import sys

from flashnext.train.command import main

sys.exit(main())
