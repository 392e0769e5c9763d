"""``python -m lmloss.sft [flags]``: the same as ``lmloss sft [flags]``."""

import sys

from lmloss.sft.cli import standalone

if __name__ == "__main__":
    sys.exit(standalone())
