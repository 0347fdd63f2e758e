"""``python -m multihead``: the same as the ``multihead`` command."""

import sys

from multihead.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
