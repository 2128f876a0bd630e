"""One error hierarchy for the whole tool; the CLI maps each class to an exit code.

Exit codes: 0 success, 1 verification failed (the thing is untrustworthy), 2 usage or malformed input to a
producing command, 3 I/O or environment trouble, 70 a bug (an unexpected exception, with its traceback).
"""

from __future__ import annotations

from shardtool.text import printable

EXIT_OK = 0
EXIT_UNTRUSTED = 1
EXIT_USAGE = 2
EXIT_IO = 3
# A bug in shardtool (an exception that is not a ShardtoolError): the traceback is printed and the exit code is
# this one (sysexits' EX_SOFTWARE), so that a script never mistakes a crash for a verdict (1) or a usage error.
EXIT_CRASH = 70


class ShardtoolError(Exception):
    """Base class. `str(err)` is one line: what happened, which file, what was expected."""

    exit_code = EXIT_UNTRUSTED

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None):
        self.message = message
        self.path = path
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """Terminal-safe: the path may be a file name from disk, the message may quote one."""
        where = f"{printable(self.path)}: " if self.path else ""
        hint = f" ({self.hint})" if self.hint else ""
        return printable(f"{self.message}{hint}", backslash=False).join((where, ""))


class UsageError(ShardtoolError):
    """Bad flags, missing directories, malformed input to a producing command."""

    exit_code = EXIT_USAGE


class TrustSettingsError(UsageError):
    """The trust settings a caller gave cannot decide anything: no trusted key, a threshold out of range, a
    model ID no manifest could carry. Raised by the trust layer about its arguments (exit 2), never a verdict."""


class StorageError(ShardtoolError):
    """Reading or writing failed for reasons outside the data itself (permissions, disk full)."""

    exit_code = EXIT_IO


class VerificationError(ShardtoolError):
    """The thing being verified is not trustworthy."""

    exit_code = EXIT_UNTRUSTED


class ManifestFormatError(VerificationError):
    """Manifest, envelope, proof or entry bytes that do not decode to exactly one canonical value."""


class SignatureError(VerificationError):
    """A signature does not verify, or a key/signature is malformed."""


class ThresholdError(VerificationError):
    """Fewer distinct trusted keys signed than the threshold requires."""


class MerkleProofError(VerificationError):
    """An inclusion proof, or an entry list, does not lead to the signed root."""


class DigestMismatchError(VerificationError):
    """A file's size or BLAKE3 digest differs from what the manifest says, or the file changed while it was
    hashed. `finding`: the audit finding class this becomes ("size-mismatch", "digest-mismatch", or
    "unreadable" for a file that changed while it was hashed)."""

    def __init__(self, message: str, *, path: str | None = None, expected: str = "", actual: str = "",
                 hint: str | None = None, finding: str = "digest-mismatch"):
        self.expected = expected
        self.actual = actual
        self.finding = finding
        super().__init__(message, path=path, hint=hint)


class MissingFileError(VerificationError):
    """A file that should be there is not (a listed shard, a named proof or key)."""


class NotARegularFileError(VerificationError):
    """Where a file should be there is a symlink, directory, FIFO, socket or device.

    `finding`: the audit finding class this becomes ("symlink" or "not-a-regular-file"); `found`: what is
    there instead ("directory", "FIFO", "socket", ...), when known."""

    def __init__(self, message: str, *, path: str | None = None, finding: str = "not-a-regular-file",
                 found: str | None = None):
        self.finding = finding
        self.found = found
        super().__init__(message, path=path)


class UnreadableFileError(VerificationError):
    """A file or directory in the checked tree that cannot be opened or read (permissions, a name too
    long, changed while it was read). Anyone who can write the tree can arrange it, so it is a finding
    about the tree (exit 1), never an I/O verdict about our machine."""


class ShardFormatError(VerificationError):
    """A shard whose bytes match the signed digest but do not parse as safetensors, or do not hold the
    tensors the signed config implies: the signed model is unusable (exit 1), not a usage error."""


class ReceiptMismatchError(VerificationError):
    """A run receipt names other weights, or claims what the verified weights do not produce."""


class RollbackError(VerificationError):
    """A manifest version lower than one already accepted for this model and key set."""


class ExpiredError(VerificationError):
    """The manifest's `expires` lies in the past (or its `created` lies in the future)."""


class RequestRefusedError(UsageError):
    """A generation request the engine can never run as asked: a prompt plus max_tokens longer than the
    context or than the whole KV cache, token ids outside the vocabulary, an empty prompt (HTTP 400). `code`:
    the machine-readable reason an HTTP error body carries ("context_length_exceeded", as OpenAI's)."""

    def __init__(self, message: str, *, code: str | None = None, **kw):
        self.code = code
        super().__init__(message, **kw)


class OverloadedError(ShardtoolError):
    """The engine's wait queue is full: the request may succeed later (HTTP 503 with Retry-After)."""

    exit_code = EXIT_IO

    def __init__(self, message: str, *, retry_after: int = 1, **kw):
        self.retry_after = retry_after
        super().__init__(message, **kw)


class UnavailableError(ShardtoolError):
    """Something the answer needs is down, not untrustworthy: a cluster node that died, timed out or refused, with
    no replica left for the experts it held (HTTP 503, exit 3). Nothing computed without it is returned."""

    exit_code = EXIT_IO


class CheckpointFormatError(ShardtoolError):
    """A checkpoint or safetensors file that cannot be parsed safely.

    Malformed input to a producing command (split) is a usage-class error (exit 2); the verifying
    paths re-raise it as a VerificationError subclass where the bytes were supposed to be signed.
    """

    exit_code = EXIT_USAGE


class KeyFileError(ShardtoolError):
    """A key file that cannot be read: wrong passphrase, wrong type, unsafe permissions."""

    exit_code = EXIT_USAGE


class InvalidRequestError(UsageError):
    """An HTTP request the server refuses as sent: a field of the wrong type or out of range, an unknown field,
    a model it does not serve, a body too large or too slow. `status` is the HTTP status (4xx); `param` names
    the field (a JSON path such as "messages[1].content"), `code` is a machine-readable reason
    ("model_not_found"), both as in OpenAI's error bodies."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        self.status = status
        self.param = param
        self.code = code
        super().__init__(message)
