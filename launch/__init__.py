"""Turns a training request into the exact command for a target, and prints or runs it.

launch renders, the engine runs: nothing in this package trains."""
