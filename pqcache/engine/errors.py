"""Every error the engine raises on purpose. Messages are written for the person who caused them:
the app shows them as they are, the CLI prints them without a traceback.

PQCacheError                    base of everything below
  InputError (also ValueError)  bad input from a user
    PQCacheConfigError          a setting out of range or inconsistent with the model
    DocumentError               a document that cannot be used: empty, binary, unsupported type,
                                over the size limit, unreadable or image-only PDF
      DocumentEncodingError     not UTF-8 text (pass encoding=...)
      DocumentTooLongError      more tokens than the model reads (or load with truncate="middle")
    NoDocumentError             a question before any document
  SessionEvictedError           the server freed this session's cache (memory cap or idle time)
  CapacityError                 busy sessions leave no room under the server's cache memory cap
  PQBuildError                  a clustering worker failed or timed out (on_pq_failure="raise")
  Cancelled                     a stop request ended a prefill or a generation
"""

from __future__ import annotations


class PQCacheError(Exception):
    """Base of the errors the engine raises on purpose."""


class InputError(PQCacheError, ValueError):
    """Bad input from a user; the message says what to change."""


class PQCacheConfigError(InputError):
    """A PQCacheConfig setting is out of range or inconsistent with the model."""


class DocumentError(InputError):
    """The document cannot be used (empty, binary, unsupported type, too large, unreadable PDF)."""


class DocumentEncodingError(DocumentError):
    """The file is not UTF-8 text; read it again with an explicit encoding."""


class DocumentTooLongError(DocumentError):
    """The document has more tokens than the model reads, leaving room for a question and answer."""

    def __init__(self, message: str, n_tokens: int, limit: int):
        super().__init__(message)
        self.n_tokens, self.limit = n_tokens, limit


class NoDocumentError(InputError):
    """A question was asked before a document was loaded."""


class SessionEvictedError(PQCacheError):
    """The server freed this session's document cache; load the document again."""


class CapacityError(PQCacheError):
    """The caches of users who are busy right now leave no room for this document under the cap."""


class PQBuildError(PQCacheError):
    """A background K-Means build failed or did not finish in time."""


class Cancelled(PQCacheError):
    """A stop request ended the prefill or the generation."""
