import sys

from trainplan.cli import entry

sys.exit(entry())
