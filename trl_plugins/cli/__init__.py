"""The command line and the tools behind it: ``trl-plugins`` (:mod:`~trl_plugins.cli.main`), ``train``, ``demo``,
``compare``, ``docs`` and ``new`` (the plugin scaffold). ``python -m trl_plugins.cli.main`` is ``trl-plugins``.
"""
