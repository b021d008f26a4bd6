"""``python -m trl_plugins.cli.main``: the ``trl-plugins`` command."""

import sys

from trl_plugins.cli.main import main

sys.exit(main())
