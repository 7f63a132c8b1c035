import sys

from qkvflow.cli import main

sys.exit(main())
