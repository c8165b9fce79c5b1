"""Reading uploaded documents: text, markdown, PDF, and readable errors for anything else."""
import pytest

import app


def _pdf(text: str) -> bytes:
    """A minimal one-page PDF with `text` in Helvetica (objects and xref written by hand)."""
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


def test_reads_pdf_text(tmp_path):
    path = tmp_path / "doc.pdf"
    path.write_bytes(_pdf("The pass key is 68422."))
    assert "The pass key is 68422." in app.read_document(str(path), None)


def test_reads_text_and_markdown_and_pasted(tmp_path):
    (tmp_path / "a.md").write_text("# Title\nbody", encoding="utf-8")
    assert app.read_document(str(tmp_path / "a.md"), "ignored") == "# Title\nbody"
    assert app.read_document(None, "pasted") == "pasted"


def test_rejects_other_files_and_broken_pdfs(tmp_path):
    (tmp_path / "x.docx").write_bytes(b"PK")
    with pytest.raises(ValueError, match="upload a .txt, .md or .pdf file"):
        app.read_document(str(tmp_path / "x.docx"), None)
    (tmp_path / "broken.pdf").write_bytes(b"not a pdf at all")
    with pytest.raises(ValueError, match="could not read the PDF"):
        app.read_document(str(tmp_path / "broken.pdf"), None)
