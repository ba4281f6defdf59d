"""Agents written as plain code for ``rollout.server`` (``module:function(sample, base_url)``)."""
