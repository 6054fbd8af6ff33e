import sys

from moekit.cli import main

sys.exit(main())
