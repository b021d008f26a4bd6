"""``python -m trl_plugins.cli``: the ``trl-plugins`` command."""

import sys

from trl_plugins.cli.commands import main

sys.exit(main())
