"""Near-duplicate detection fitted on each collection: edited copies (edits.py), thumbnails and descriptors
(descriptors.py), pair alignment (align.py), the self-supervised classifier (model.py), one scan (scan.py),
the `softsearch dedup` job (job.py) and its page (page.py); constants in config.py."""

from index.lazy import lazy_exports

__all__ = ["DedupConfig", "DuplicateModel", "edited_copy", "scan_collection", "groups_of"]
__getattr__ = lazy_exports(
    __name__,
    {
        "DedupConfig": "search.duplicates.config",
        "DuplicateModel": "search.duplicates.model",
        "edited_copy": "search.duplicates.edits",
        "scan_collection": "search.duplicates.scan",
        "groups_of": "search.duplicates.scan",
    },
)
