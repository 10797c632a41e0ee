"""Azure Blob Storage: ``az://account/container/prefix`` (and the portal's
``https://<account>.blob.core.windows.net/<container>/<prefix>``). The declaration is
:mod:`.backend`; the source (:mod:`.source`), its credentials (:mod:`.auth`) and its listing
reader (:mod:`.listing`) are imported when a source is opened."""
