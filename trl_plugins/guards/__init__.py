"""The guards the trainer puts around user input: the training dataset, reward functions and tools.

They refuse at construction what TRL would only trip over mid-run, and hold errors raised on one process until
every process can raise them together. They build only on :mod:`trl_plugins.api`.
"""
