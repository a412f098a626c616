import sys

from fastroute.cli import main

sys.exit(main())
