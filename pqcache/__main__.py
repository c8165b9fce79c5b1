import sys

from pqcache.tools.cli import main

sys.exit(main())
