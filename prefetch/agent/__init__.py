"""``prefetch agent``, the DaemonSet process: small parts with one job each, wired by
:class:`~prefetch.agent.loop.Agent` (docs/architecture.md, "The agent")."""
