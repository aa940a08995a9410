"""``python -m padless.testing.fuzz``: the sweep (:mod:`padless.testing.fuzz.sweep`)."""

import sys

from padless.testing.fuzz.sweep import main

sys.exit(main())
