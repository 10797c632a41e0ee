"""The package's one exception hierarchy.

Every error a user can cause or meet derives from :class:`PrefetchError`; the CLI turns any of them
into one ``Error: ...`` line (plus an optional ``Hint: ...``) and a non-zero exit. Errors subclass a
builtin where that is true, so callers can also catch them as ``FileNotFoundError`` and the like.

::

    PrefetchError
    ├── ConfigError (ValueError)             a malformed URI, flag, size or config file field
    ├── SourceError                          anything the remote side said or failed to say
    │   ├── NotFoundError (FileNotFoundError)
    │   │   ├── BucketNotFoundError          S3 bucket does not exist
    │   │   ├── RepoNotFoundError            Hub repository does not exist (or is hidden)
    │   │   ├── RevisionNotFoundError        branch, tag or commit unknown
    │   │   └── NoMatchingFilesError         include/exclude patterns matched nothing
    │   ├── AccessDeniedError (PermissionError)  401/403, bad or missing credentials / token
    │   ├── SourceChangedError               the object changed under a pinned download (ETag/412)
    │   │   └── RangeIgnoredError            a ranged GET answered 200 and the whole object
    │   ├── InvalidListingError              a listed entry that cannot be a file (a negative
    │   │   │                                size, no blob id, a malformed LFS block): refused
    │   │   │                                before any byte is fetched
    │   │   └── UnsafePathError              a path that could escape DEST or clash: `..`, a leading
    │   │                                    `/`, `.`/empty segments, control characters, a file
    │   │                                    and a directory of one name, the reserved `.prefetch/`
    │   ├── TlsError                         a certificate refused (untrusted, another name,
    │   │                                    expired) or no TLS at all: never retried
    │   └── TransientSourceError             timeouts, resets, 5xx, throttling (retried)
    ├── TransferError                        a download could not be completed
    │   ├── InsufficientSpaceError (OSError) not enough free space (before or during the pull)
    │   ├── DeadlineExceededError            the pull's --deadline or the agent's syncDeadline
    │   │                                    passed (partials are kept)
    │   └── Cancelled                        asked to stop (SIGTERM); resumable state is kept
    ├── VerifyError
    │   ├── ChecksumMismatchError            carries path, algorithm, expected, actual
    │   └── MissingChecksumError             --require-checksum and the source has none
    ├── LayoutError                          the destination cannot be written / is not ours
    │   └── LockTimeoutError                 another pull holds the model's lock for too long
    ├── NodeGateError                        the Kubernetes API refused a node label/taint change
    ├── ClusterReadError                     prefetch status could not read the Nodes (no
    │                                        kubeconfig, unreachable API server, 401/403)
    └── CompileCacheError                    a compile cache that cannot be pushed (not
        │                                    finished, still changing) or a bad cache key
        └── CompileCacheRefused              holds a symlink or a non-file, or a file was
                                             swapped or changed after its check

Each kind of failure has one stable name, :func:`error_reason` (table :data:`ERROR_REASONS`):
the CLI's ``error_reason`` in ``--json`` and the agent's ``reason`` (the sync-failures metric's
label, ``/readyz``'s ``error_reason``, the SyncFailed Event and ``prefetch status``) both use it.
"""

from __future__ import annotations


class PrefetchError(Exception):
    """Root of every error model-prefetch raises on purpose."""

    hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class ConfigError(PrefetchError, ValueError):
    """Bad user input: a URI, a flag value, a config file field."""


class SourceError(PrefetchError):
    """The source (S3, Hub) refused or failed a request."""


class NotFoundError(SourceError, FileNotFoundError):
    """Something named by the user does not exist at the source."""


class BucketNotFoundError(NotFoundError):
    pass


class RepoNotFoundError(NotFoundError):
    pass


class RevisionNotFoundError(NotFoundError):
    pass


class NoMatchingFilesError(NotFoundError):
    pass


class AccessDeniedError(SourceError, PermissionError):
    pass


class SourceChangedError(SourceError):
    """The remote object changed while we were downloading it (ETag no longer matches)."""


class RangeIgnoredError(SourceChangedError):
    """A ranged GET answered ``200`` and the whole object (a cold pull-through cache does):
    its bytes cannot be written at the range's offset; another source may serve the range."""


class InvalidListingError(SourceError):
    """The source listed an entry no file can have; the whole snapshot is refused before any
    byte is fetched, so a hostile or broken server never gets a partial model published."""


class UnsafePathError(InvalidListingError):
    """A listed path that could write outside the destination, into the tool's own state, or
    over another listed file. ``path`` is the offending path as the source gave it."""

    def __init__(self, message: str, *, path: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class TlsError(SourceError):
    """TLS to the source failed in a way no retry fixes: its certificate was refused (another
    CA, another name, expired) or the port does not speak TLS. Never retried."""


class TransientSourceError(SourceError):
    """A failure worth retrying: timeout, connection reset, 5xx, throttling.

    ``retry_after`` is the server's requested delay in seconds, when it gave one.
    """

    def __init__(
        self, message: str, *, retry_after: float | None = None, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.retry_after = retry_after


class ThrottledError(TransientSourceError):
    """The server asks the client to slow down (S3's ``503 SlowDown``, a 429): retried like
    any transient failure, and the client's request rate to that server is lowered."""


class TransferError(PrefetchError):
    pass


class InsufficientSpaceError(TransferError, OSError):
    pass


class DeadlineExceededError(TransferError):
    """The transfer's overall deadline passed; it stopped resumably (partials stay journaled)."""


class Cancelled(TransferError):
    """The transfer was asked to stop (SIGTERM); resumable state is left on disk."""


class VerifyError(PrefetchError):
    pass


class ChecksumMismatchError(VerifyError):
    def __init__(self, path: str, algorithm: str, expected: str, actual: str) -> None:
        super().__init__(
            f"checksum mismatch for {path}: {algorithm} expected {expected}, got {actual}"
        )
        self.path = path
        self.algorithm = algorithm
        self.expected = expected
        self.actual = actual


class MissingChecksumError(VerifyError):
    pass


class LayoutError(PrefetchError):
    pass


class LockTimeoutError(LayoutError, TimeoutError):
    pass


class NodeGateError(PrefetchError):
    pass


class ClusterReadError(PrefetchError):
    """Reading the cluster with the user's kubeconfig failed (``prefetch status``)."""


class CompileCacheError(PrefetchError):
    """A compile cache that cannot be published as asked (see prefetch.publish.compile_cache)."""


class CompileCacheRefused(CompileCacheError):
    """A compile cache that holds what a cache must not (a symlink, a device, a file swapped
    or changed after its check): refused until its directory changes, not a passing state."""


#: The one vocabulary of failure kinds, for scripts and dashboards (an error's message is for
#: people and may change). Subclasses first: the first class the exception is an instance of
#: names it; anything else is ``internal`` (a bug).
ERROR_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (ChecksumMismatchError, "checksum_mismatch"),
    (MissingChecksumError, "missing_checksum"),
    (VerifyError, "verify_failed"),
    (NoMatchingFilesError, "no_matching_files"),
    (NotFoundError, "not_found"),
    (AccessDeniedError, "access_denied"),
    (SourceChangedError, "source_changed"),
    (TlsError, "tls"),
    (TransientSourceError, "transient"),
    (SourceError, "source_error"),
    (InsufficientSpaceError, "insufficient_space"),
    (DeadlineExceededError, "deadline"),
    (Cancelled, "cancelled"),
    (TransferError, "transfer_failed"),
    (LockTimeoutError, "lock_timeout"),
    (LayoutError, "layout"),
    (ConfigError, "config"),
    (NodeGateError, "node_gate"),
    (CompileCacheError, "compile_cache"),
    (PrefetchError, "error"),
    (KeyboardInterrupt, "cancelled"),
    (OSError, "os_error"),
)


def error_reason(exc: BaseException) -> str:
    """The stable name of ``exc``'s kind (see :data:`ERROR_REASONS`); ``internal`` for a bug."""
    return next((reason for cls, reason in ERROR_REASONS if isinstance(exc, cls)), "internal")
