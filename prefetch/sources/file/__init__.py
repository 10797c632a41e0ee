"""The mounted-filesystem backend: ``file:///mnt/models/llama/`` (NFS, Lustre/FSx, a PVC
mounted into the pod), copied with the engine's chunks and never modified. The declaration is
:mod:`.backend`; the source (:mod:`.source`) is imported when opened."""
