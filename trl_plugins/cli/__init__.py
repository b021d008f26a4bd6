"""The command line and the tools behind it: ``trl-plugins`` (:func:`main`, in :mod:`~trl_plugins.cli.commands`)
and its ``train``, ``demo``, ``compare``, ``docs`` and ``new`` (the plugin scaffold) commands.
``python -m trl_plugins.cli`` is ``trl-plugins``.
"""

from trl_plugins.cli.commands import main

__all__ = ["main"]
