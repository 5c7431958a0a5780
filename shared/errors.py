"""The DroidMesh error hierarchy.

Every failure a caller can act on has its own class, so a receiver can tell "fall back to
full prefill" (any `ReuseError`) from "this request itself is bad" (`BadRequestError`) and
services can turn each into a specific error reply. `code` is the stable, wire-visible name.
"""

from __future__ import annotations


class DroidMeshError(Exception):
    """Base of all DroidMesh errors."""

    code = "internal"


class ConfigError(DroidMeshError, ValueError):
    """A configuration value is missing or out of range."""

    code = "bad_config"


class CheckpointNotFoundError(DroidMeshError, FileNotFoundError):
    """A model path does not exist locally (DroidMesh never downloads weights)."""

    code = "checkpoint_not_found"


class UnsupportedModelError(DroidMeshError):
    """The checkpoint's architecture is outside what the engine supports."""

    code = "unsupported_model"


class BadRequestError(DroidMeshError, ValueError):
    """A request is malformed (empty prompt, bad layer group, ...)."""

    code = "bad_request"


class NoSignalError(BadRequestError):
    """Profile rows that cannot support a choice: the receiver's own full prefill scores near
    zero on them, or the metric scores every path alike (`shared/profiling/evidence.py`)."""

    code = "no_signal"


class ReuseError(DroidMeshError):
    """Reusing another model's cache is not possible; the caller falls back to full prefill."""

    code = "reuse_failed"


class IncompatibleModelsError(ReuseError):
    """Sender and receiver architecture fingerprints differ; `diff` names each differing field."""

    code = "incompatible_models"

    def __init__(self, diff: dict[str, tuple[object, object]]):
        self.diff = diff
        parts = ", ".join(f"{k}: sender={a!r} receiver={b!r}" for k, (a, b) in sorted(diff.items()))
        super().__init__(f"architectures differ: {parts}")


class CacheLayoutError(ReuseError):
    """A delivered tensor's shape, dtype or device does not match the receiver's expected layout."""

    code = "cache_layout"


class MissingLayerError(ReuseError):
    """A layer's KV or E tensor never arrived (deadline passed, or the source gave up)."""

    code = "missing_layer"


class BadMessageError(BadRequestError):
    """Bytes that are not a valid message: undecodable, wrong field types, oversize."""

    code = "bad_message"


class SchemaVersionError(BadMessageError):
    """A message of a schema version this build does not speak."""

    code = "schema_version"


class DeadlineExceededError(DroidMeshError):
    """The request's deadline passed before it could be served."""

    code = "deadline_exceeded"


class TransferError(ReuseError):
    """A bulk transfer failed (peer gone, refused, unknown context)."""

    code = "transfer_failed"


class IntegrityError(ReuseError):
    """A transferred tensor's checksum, shape or dtype did not match its header, a value is not
    finite or out of range, or it fails the receiver's statistics screen (`shared/kv/screen.py`)."""

    code = "integrity"


class MapsNotFoundError(ReuseError):
    """A pair config names SCD maps the maps store does not hold (not published, or lost)."""

    code = "maps_not_found"


class UnauthorizedError(DroidMeshError):
    """A pull without a valid grant (missing, wrong, expired, used, another context's)."""

    code = "unauthorized"


class OverloadedError(DroidMeshError):
    """The service holds as many requests as it is configured to; this one is refused at once
    (load shedding) rather than queued until it times out. The client may retry elsewhere or later."""

    code = "overloaded"


class PeerUnreachableError(TransferError):
    """A sender's bulk address could not be connected to (refused, gone, or no answer in time)."""

    code = "peer_unreachable"


class AuthenticationError(DroidMeshError):
    """No API key, a malformed one, or one that is not in the key file (the gateway's 401)."""

    code = "invalid_api_key"


class PermissionDeniedError(DroidMeshError):
    """A valid API key asking for something it is not given, e.g. a model it may not use (403)."""

    code = "permission_denied"


class QuotaExceededError(DroidMeshError):
    """A client over one of its limits (requests per minute, tokens per minute, requests at once);
    `retry_after_s` is when retrying can succeed, as far as the limit that refused can tell (429)."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s
