"""The embedded dev stack: its processes (`stack`: `DevStack`, `dev up/down/status`) and the
supervisor that starts a dead one again (`supervisor`), which `dev status` reads."""

__all__ = ["stack", "status_file", "supervisor"]
