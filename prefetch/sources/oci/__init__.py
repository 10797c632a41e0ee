"""The OCI registry backend: its declaration (``backend``) and the source it opens (``source``)."""
