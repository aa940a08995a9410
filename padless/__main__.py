"""``python -m padless``: the ``padless`` command (see :mod:`padless.cli`)."""

from padless.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
