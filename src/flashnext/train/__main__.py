"""`python -m flashnext.train --config run.toml [--section.field=value ...]` (also under torchrun)."""

import sys

from flashnext.train.trainer import main

sys.exit(main())
