"""Reading documents: text, markdown, PDF, pasted text, and a documented error for every bad input."""

import codecs

import pytest

from pqcache.engine.errors import DocumentEncodingError, DocumentError, InputError
from pqcache.serving.documents import read_document


def make_pdf(text: str | None) -> bytes:
    """A minimal one-page PDF (objects and xref written by hand): `text` in Helvetica, or with
    text=None only a filled rectangle, like a scanned page without a text layer."""
    if text is None:
        stream = b"0 0 1 rg 72 72 200 200 re f"
    else:
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


# name, bytes, error type, message fragment: every bad file a user can upload
BAD_FILES = [
    ("empty.txt", b"", DocumentError, "empty.txt is empty"),
    ("blank.md", b"  \n\t \n", DocumentError, "blank.md is empty"),
    ("image.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(200), DocumentError, "looks like a binary file"),
    (
        "broken.pdf",
        b"not a pdf at all",
        DocumentError,
        r"broken.pdf is not a PDF \(it has no PDF header; it looks like text\)",
    ),
    ("corrupt.pdf", b"%PDF-1.4\n" + bytes(range(256)), DocumentError, "could not read the PDF corrupt.pdf"),
    ("photo.pdf", b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(200), DocumentError, "it looks like some other kind of file"),
    ("truncated.pdf", make_pdf("The pass key is 1.")[:60], DocumentError, "could not read the PDF"),
    ("scan.pdf", make_pdf(None), DocumentError, "no text layer"),
    ("report.docx", b"PK\x03\x04", DocumentError, "unsupported file type"),
    ("notes", bytes(range(256)) * 4, DocumentError, "notes: unsupported file type"),
    ("latin.txt", "Café crème".encode("cp1252"), DocumentEncodingError, r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
]


@pytest.mark.parametrize("name,data,error,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_raise_documented_errors(tmp_path, name, data, error, message):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(error, match=message) as info:
        read_document(str(path))
    assert isinstance(info.value, InputError) and isinstance(info.value, ValueError)


def test_size_limit_for_files_and_pasted_text(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"word " * 3000)
    with pytest.raises(DocumentError, match=r"big.txt is 0.0 MiB; the limit is 0.0 MiB"):
        read_document(str(path), max_bytes=10_000)
    assert read_document(str(path), max_bytes=20_000).startswith("word word")
    with pytest.raises(DocumentError, match="pasted text is over"):
        read_document(None, "x" * 10_001, max_bytes=10_000)
    with pytest.raises(DocumentError, match="cannot open gone.txt"):
        read_document(str(tmp_path / "gone.txt"))


def test_reads_pdf_text_markdown_and_pasted(tmp_path):
    (tmp_path / "doc.pdf").write_bytes(make_pdf("The pass key is 68422."))
    assert "The pass key is 68422." in read_document(str(tmp_path / "doc.pdf"))
    (tmp_path / "a.md").write_text("# Title\nbody", encoding="utf-8")
    assert read_document(str(tmp_path / "a.md"), "ignored") == "# Title\nbody"
    assert read_document(None, "pasted") == "pasted"
    with pytest.raises(DocumentError, match="the document is empty"):
        read_document(None, " \n ")
    for nothing in (None, ""):  # Load with no file and no text
        with pytest.raises(DocumentError, match="nothing to load: attach a file or paste text first"):
            read_document(None, nothing)


def test_encodings(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes("Café crème".encode("cp1252"))
    assert read_document(str(path), encoding="cp1252") == "Café crème"
    with pytest.raises(DocumentEncodingError, match="unknown text encoding 'klingon'"):
        read_document(str(path), encoding="klingon")
    (tmp_path / "bom16.txt").write_bytes(codecs.BOM_UTF16_LE + "Grüße".encode("utf-16-le"))
    assert read_document(str(tmp_path / "bom16.txt")) == "Grüße"
    (tmp_path / "bom8.txt").write_bytes(codecs.BOM_UTF8 + "naïve".encode())
    assert read_document(str(tmp_path / "bom8.txt")) == "naïve"
    path.write_bytes("Cafés".encode("cp1252"))  # 5 bytes: not UTF-16
    with pytest.raises(DocumentEncodingError, match="not valid utf-16"):
        read_document(str(path), encoding="utf-16")
