import sys

from torchnative.cli import main

sys.exit(main())
