import sys

from triscope.cli import main

sys.exit(main())
