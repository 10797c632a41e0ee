"""The sync pipeline: spec -> resolve -> layout -> prepare -> make room -> execute -> warm.

:mod:`.compose` holds the one :class:`~prefetch.pipeline.compose.Pipeline` every entry point runs;
the stages are the modules beside it (docs/architecture.md has the tour). This ``__init__`` imports
nothing, so a module that needs only the vocabulary (a backend declaration reading
:mod:`.spec_terms`) does not load the engine.
"""
