"""ipnext: the whole life of a model deployment, from publishing to serving.

The core (spec models, config, errors, SDK, CLI, dev stack) lives here; the
layers (`workflows`, `activities`, `planner`, `serving`, `kernels`, `examples`)
are sibling packages reached through `ipnext.<layer>`.
"""

__version__ = "0.1.0"
