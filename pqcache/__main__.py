import sys

from pqcache.cli.main import main

sys.exit(main())
