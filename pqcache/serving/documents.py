"""Reading a user's document into text: .txt, .md, .pdf files, other files whose content is text, standard input
(read_bytes) or pasted text.

Everything that cannot become useful text raises DocumentError (or DocumentEncodingError) with a
message that says what to do. Text files must be UTF-8 (a BOM, UTF-8 or UTF-16, is honoured) unless
`encoding` names another codec: guessing a legacy codepage silently would garble the answers.
"""

from __future__ import annotations

import codecs
import os

from pqcache.engine.errors import DocumentEncodingError, DocumentError

MAX_DOCUMENT_BYTES = 10 * 2**20  # 10 MiB: far more text than any context holds, and a few large PDFs
TEXT_TYPES = (".txt", ".md")
SUPPORTED_TYPES = TEXT_TYPES + (".pdf",)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_text(text: str, source: str = "the document") -> str:
    if not text or not text.strip():
        raise DocumentError(f"{source} is empty")
    return text


def looks_binary(data: bytes) -> bool:
    """NUL bytes, or many control characters, in the first 8 KiB: not a text file."""
    head = data[:8192]
    if b"\x00" in head and not head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return True
    control = sum(1 for byte in head if byte < 32 and byte not in (9, 10, 12, 13, 27))
    return len(head) > 0 and control / len(head) > 0.1


def decode_text(data: bytes, name: str, encoding: str | None = None) -> str:
    """Bytes of a text file -> str (UTF-8 / BOM, or the given encoding)."""
    if encoding:
        try:
            return data.decode(encoding)
        except LookupError:
            raise DocumentEncodingError(f"unknown text encoding {encoding!r}") from None
        except UnicodeDecodeError as exc:
            raise DocumentEncodingError(
                f"{name} is not valid {encoding} text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
            ) from None
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return data.decode("utf-16")
    if looks_binary(data):
        raise DocumentError(f"{name} looks like a binary file, not text: upload a .txt, .md or .pdf document")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DocumentEncodingError(
            f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): save it as UTF-8, "
            "or choose its encoding (for example cp1252 or latin-1)"
        ) from None


def read_pdf(path: str, name: str) -> str:
    from pypdf import PdfReader

    try:
        reader = PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{name} is a password-protected PDF: remove the password first")
        text = "\n".join(page.extract_text() or "" for page in reader.pages)
    except DocumentError:
        raise
    except Exception as exc:  # pypdf raises many kinds (struct, zlib, key, recursion errors) on broken files
        raise DocumentError(f"could not read the PDF {name}: {exc or type(exc).__name__}") from exc
    if not text.strip():
        raise DocumentError(
            f"{name} has no text layer (a scanned or image-only PDF?): run OCR on it or paste the text instead"
        )
    return text


def read_bytes(data: bytes, name: str, encoding: str | None = None, max_bytes: int = MAX_DOCUMENT_BYTES) -> str:
    """The text of a document given as bytes with no known file type (a file without a known extension,
    standard input): a PDF (by its %PDF- header) or text; binary content is refused as an unsupported type."""
    if len(data) > max_bytes:
        raise DocumentError(f"{name} is over the {_mib(max_bytes)} limit")
    if data.startswith(b"%PDF-"):
        import io

        return check_text(read_pdf(io.BytesIO(data), name), name)
    if looks_binary(data):
        raise DocumentError(f"{name}: unsupported file type; upload a .txt, .md or .pdf file")
    return check_text(decode_text(data, name, encoding), name)


def read_document(
    path: str | None = None, text: str | None = None, encoding: str | None = None, max_bytes: int = MAX_DOCUMENT_BYTES
) -> str:
    """The text of the file at `path` (.txt, .md, .pdf; a file with another or no extension when its content is
    text), else `text` (pasted). Raises DocumentError."""
    if path:
        name = os.path.basename(path)
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise DocumentError(f"cannot open {name}: {exc.strerror}") from None
        if size > max_bytes:
            raise DocumentError(f"{name} is {_mib(size)}; the limit is {_mib(max_bytes)}")
        if not name.lower().endswith(SUPPORTED_TYPES):  # read when its content is text
            with open(path, "rb") as f:
                return read_bytes(f.read(), name, encoding, max_bytes)
        if name.lower().endswith(".pdf"):
            with open(path, "rb") as f:
                head = f.read(1024)  # a PDF's header is within its first 1024 bytes
            if b"%PDF-" not in head:
                what = "text" if head.strip() and not looks_binary(head) else "some other kind of file"
                raise DocumentError(
                    f"{name} is not a PDF (it has no PDF header; it looks like {what}): if it is text, name it .txt"
                )
            return check_text(read_pdf(path, name), name)
        with open(path, "rb") as f:
            return check_text(decode_text(f.read(), name, encoding), name)
    text = text or ""
    if not text:
        raise DocumentError("nothing to load: attach a file or paste text first")
    if len(text.encode("utf-8", errors="replace")) > max_bytes:
        raise DocumentError(f"the pasted text is over the {_mib(max_bytes)} limit")
    return check_text(text, "the document")
