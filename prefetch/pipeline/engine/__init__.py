"""The chunk engine: ranged reads of many files under one concurrency limit, resumable and
verified. :mod:`.transfer` (``Transfer``) schedules a pull's tasks on the :mod:`.coordinator`'s
thread pools; :mod:`.plan` describes files and plans their chunks, :mod:`.resume` reopens a
partial file from its :mod:`.journal`, :mod:`.fetch` is the read loop, :mod:`.finish` seals and
checks a file; :mod:`.partial_file` and :mod:`.watched_read` are what the mirror writer shares;
:mod:`.processes` runs the engine in worker processes (``--processes``)."""
