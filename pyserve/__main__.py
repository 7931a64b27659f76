import sys

from pyserve.cli import main

sys.exit(main())
