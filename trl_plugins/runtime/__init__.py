"""The runtime: the trainer subclass and what runs a step (stages, loss path, generation service, refill, reference
model, LM-head statistics, policy probe), the TRL seam, the plugin manager, configuration, models and checkpoints.

Plugins never import it; it builds on :mod:`trl_plugins.api`, :mod:`trl_plugins.guards` and
:mod:`trl_plugins.components`.
"""
