"""The entry tier's growing room: what the CLI, the SDK, the worker and the dev stack are made of.

Modules here may import every layer; nothing but `ipnext/{cli,sdk,worker,devstack}.py`, tests,
bench and examples imports them (the layering test enforces it).
"""
