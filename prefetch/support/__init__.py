"""Small things every layer uses: errors, units, redaction, JSON, settings, paths."""
