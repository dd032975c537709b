"""The files ipnext keeps outside Temporal: snapshot folders and their checks (`snapshots`,
`validation`), the pinned copies replicas load (`pinned`), fleet plans (`plans`), the API keys
file (`keys`) and the Ray token (`ray_token`). Each is written atomically and read with errors that
name the file."""

__all__ = ["keys", "pinned", "plans", "ray_token", "snapshots", "validation"]
