"""First-party trl-plugins plugins (import name ``trl_plugins_builtin``), one module per paper."""
