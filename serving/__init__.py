"""Serving on Ray Serve: a router app per (model, region), a set app per snapshot set, one
writer that owns the whole declarative Serve config, and a metrics actor per (model, region).

Deployment code (router, part hosting, set apps) is imported by Ray Serve from the
import paths in `ipnext.serving.apps`; the worker drives everything through
`ipnext.serving.control`.
"""
