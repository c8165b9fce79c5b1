"""The document store: a loaded document's cache kept on disk, so that a document is read once, ever.

An entry is a folder under the store's root (default $PQCACHE_HOME/documents), named by its key:

    <key>/tensors.safetensors   the cache's tensors (engine/snapshot.py): keys, values, PQ codes and centroids,
                                the sliding-window layers' windows
    <key>/document.txt          the document's text (what a reopen from the app's "Your documents" reads)
    <key>/manifest.json         token ids, the model's and the tokenizer's fingerprints, the settings that shaped
                                the cache, the text's hash, sizes, creation and last-use times

The key hashes everything that decides the cache's content (the model's weights and dtype, the tokenizer, the token
ids, the method and the K-Means settings), so the same text loaded with the same model and settings finds its entry,
and nothing else does. Writes go to a temporary folder that is renamed into place: a crash midway leaves no entry
that opens, and of two writers of the same entry (two tabs) the first rename wins. An entry that is truncated,
corrupt or made for another model raises StoreError with one line; the caller reads the document from its text.
Past the size cap, the least recently used entries go.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import torch

from pqcache.engine.errors import InputError
from pqcache.serving.home import store_root

FORMAT = 1
TENSORS, MANIFEST, TEXT = "tensors.safetensors", "manifest.json", "document.txt"
STALE_TMP_S = 3600.0  # a temporary folder this old was left by a writer that died
KEY_SETTINGS = (
    "m",
    "bits",
    "metric",
    "opq",
    "seed",
    "kmeans_iters",
    "n_init",
    "kv_dtype",
)  # what shapes the saved cache


class StoreError(InputError):
    """A store entry that cannot be used (the document is read from its text instead), or a store that cannot be
    written (the document stays loaded, unsaved)."""


class NotInStore(StoreError, KeyError):
    """The store holds no entry under that key: not a fault, the load prefills (a KeyError, as a dict's miss)."""

    def __str__(self) -> str:
        return "not in the store"


def model_fingerprint(model) -> str:
    """The weights' identity: the config, the dtype, and a sample of a few tensors' values (the first, middle and
    last parameters: a fine-tune or another quantization changes them). Computed once per model."""
    cached = getattr(model, "_pqcache_fingerprint", None)
    if cached:
        return cached
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    params = list(model.named_parameters())
    for name, param in [params[0], params[len(params) // 2], params[-1]]:
        sample = param.detach().reshape(-1)[:4096].to("cpu", torch.float32)
        digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode() + sample.numpy().tobytes())
    model._pqcache_fingerprint = digest.hexdigest()[:32]
    return model._pqcache_fingerprint


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's identity: its serialized form (0.34 s for the bundled model's, so computed once per
    tokenizer, as the model's)."""
    cached = getattr(tokenizer, "_pqcache_fingerprint", None)
    if cached:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = getattr(tokenizer, "vocab_size", None)
    text = (
        backend.to_str() if backend is not None else f"{type(tokenizer).__module__}.{type(tokenizer).__name__}:{vocab}"
    )
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:32]
    try:
        tokenizer._pqcache_fingerprint = fingerprint
    except AttributeError:  # a tokenizer that takes no attributes: computed again next time
        pass
    return fingerprint


def default_cap_bytes(root: Path) -> int:
    """A quarter of the free disk where the store lives."""
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    return shutil.disk_usage(probe).free // 4


class DocumentStore:
    def __init__(self, root: str | Path | None = None, cap_bytes: int | None = None):
        self.root = Path(root) if root is not None else store_root()
        self.cap_bytes = cap_bytes if cap_bytes is not None else default_cap_bytes(self.root)

    # ---- keys and manifests --------------------------------------------------------------------------------
    def describe(self, model, tokenizer, config, method: str, keep_queries: bool, ids: list[int]) -> dict:
        """What an entry for this load must match: the fields its key hashes."""
        return {
            "format": FORMAT,
            "model": model_fingerprint(model),
            "dtype": str(next(model.parameters()).dtype),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "method": method,
            "keep_queries": bool(keep_queries),
            "settings": {name: getattr(config, name) for name in KEY_SETTINGS},
            "ids_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        }

    @staticmethod
    def key(described: dict) -> str:
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:40]

    def has(self, key: str) -> bool:
        return (self.root / key / MANIFEST).exists()

    # ---- reading -----------------------------------------------------------------------------------------------
    def open(self, key: str, described: dict) -> tuple[dict, dict]:
        """-> (tensors, manifest) of an entry made for `described`; StoreError says why one cannot be used."""
        folder = self.root / key
        try:
            manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise NotInStore(key) from None
        except (OSError, ValueError) as exc:
            raise StoreError(f"its stored copy has an unreadable manifest ({exc})") from None
        made_for = manifest.get("for", {})
        differ = [name for name in described if made_for.get(name) != described[name]]
        if differ:
            raise StoreError(f"its stored copy was made for another {', '.join(differ)}")
        path = folder / TENSORS
        try:
            size = path.stat().st_size
            if size != manifest.get("bytes"):
                raise StoreError(f"its stored copy is {size:,} bytes, {manifest.get('bytes'):,} were written")
            from safetensors.torch import load_file

            tensors = load_file(path)
        except StoreError:
            raise
        except Exception as exc:  # a corrupt header or tensor: safetensors' own errors
            raise StoreError(f"its stored copy is unreadable ({type(exc).__name__}: {exc})") from None
        manifest["last_used"] = time.time()
        try:
            self._write_manifest(folder, manifest)
        except OSError:  # a read-only store still serves what it holds
            pass
        return tensors, manifest

    def text(self, key: str) -> str:
        """The text an entry was made from (StoreError when the entry is gone or has none)."""
        if not key or "/" in key or key.startswith("."):
            raise StoreError("not a document of the store")
        try:
            return (self.root / key / TEXT).read_text(encoding="utf-8")
        except (OSError, ValueError):
            raise StoreError("that document is no longer in the store") from None

    def entries(self) -> list[dict]:
        """Every readable manifest, most recently used first (each with its `key`)."""
        out = []
        for folder in self.root.glob("*/"):
            try:
                manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            out.append({**manifest, "key": folder.name})
        return sorted(out, key=lambda m: m.get("last_used", 0), reverse=True)

    # ---- writing -----------------------------------------------------------------------------------------------
    def save(self, key: str, tensors: dict, manifest: dict, text: str | None = None) -> int:
        """Write an entry (a temporary folder, then a rename). Returns its bytes on disk; StoreError when the store
        cannot be written (read-only, full). An entry already there (another writer was first) is kept."""
        from safetensors.torch import save_file

        if self.has(key):
            return 0
        tmp = self.root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            save_file(tensors, tmp / TENSORS)
            if text is not None:
                (tmp / TEXT).write_text(text, encoding="utf-8")
            size = (tmp / TENSORS).stat().st_size
            now = time.time()
            self._write_manifest(tmp, {**manifest, "bytes": size, "created": now, "last_used": now})
            try:
                tmp.rename(self.root / key)
            except OSError:  # the same entry written meanwhile (os.rename does not replace a full folder)
                if not self.has(key):
                    raise
                return 0
        except OSError as exc:
            raise StoreError(f"the document store at {self.root} cannot be written ({exc.strerror or exc})") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.evict(keep=key)
        return size

    def _write_manifest(self, folder: Path, manifest: dict):
        tmp = folder / f".{MANIFEST}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(manifest), encoding="utf-8")
        os.replace(tmp, folder / MANIFEST)

    def delete(self, key: str) -> bool:
        folder = self.root / key
        if not folder.is_dir() or folder.name.startswith("."):
            return False
        shutil.rmtree(folder, ignore_errors=True)
        return True

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used entries until the store is within its cap (never `keep`), and what writers
        that died midway left (temporary folders over an hour old)."""
        for tmp in self.root.glob(".tmp-*"):
            try:
                if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
                    shutil.rmtree(tmp, ignore_errors=True)
            except OSError:
                pass
        entries = self.entries()
        total, gone = sum(e.get("bytes", 0) for e in entries), []
        for entry in reversed(entries):  # the least recently used first
            if total <= self.cap_bytes:
                break
            if entry["key"] != keep and self.delete(entry["key"]):
                total -= entry.get("bytes", 0)
                gone.append(entry["key"])
        return gone
