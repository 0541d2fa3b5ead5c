"""`python -m moetune_cli ARGS`: the `moetune` command without the installed script."""
import sys

from moetune_cli import main

sys.exit(main())
